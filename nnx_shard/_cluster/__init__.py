"""Processes and pods: the distributed runtime, the launcher, barriers, host-local data, TPU topologies."""
