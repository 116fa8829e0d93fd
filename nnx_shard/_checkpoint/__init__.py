"""Checkpoints: the Checkpointer, reads, plain Orbax, the directory, faults, fingerprints, snapshots."""
