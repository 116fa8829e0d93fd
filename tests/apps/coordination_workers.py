"""Workers of tests/cluster/test_coordination.py: each process talks to the others through ``_cluster``."""

from __future__ import annotations


def exchange() -> dict:
    import jax

    from nnx_shard._cluster import Keys, KeyValueStore, all_to_all, gather_json

    me, n = jax.process_index(), jax.process_count()
    store = KeyValueStore()
    store.set(f"{Keys.WATCHDOG}{me}", f"section of {me}")
    gathered = gather_json({"process": me, "square": me * me})
    received = all_to_all([f"{me}->{q}".encode() for q in range(n)])
    other = store.get(f"{Keys.WATCHDOG}{(me + 1) % n}", 60_000)
    return {
        "gathered": gathered,
        "received": [bytes(r).decode() for r in received],
        "other": other,
        "directory": sorted(store.directory(Keys.WATCHDOG).values()),
    }
