"""Entry point of one worker process of a multi-process test (see tests/apps/multihost.py)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

HEARTBEAT_S = 10
SHUTDOWN_S = 10


def main() -> int:
    target, port, n, pid, devices, args_json, out = sys.argv[1:]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    import jax

    jax.config.update("jax_num_cpu_devices", int(devices))
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        int(n),
        int(pid),
        initialization_timeout=60,
        heartbeat_timeout_seconds=HEARTBEAT_S,
        shutdown_timeout_seconds=SHUTDOWN_S,
    )
    module, name = target.split(":")
    result: dict = {"pid": int(pid)}
    rc = 0
    try:
        result["value"] = getattr(importlib.import_module(module), name)(**json.loads(args_json))
    except BaseException as e:  # report everything, including SystemExit
        result.update(error=type(e).__name__, message=str(e), traceback=traceback.format_exc())
        rc = 1
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.rename(out)
    # Leave together: a process that exits first breaks the others' collectives.
    try:
        jax.distributed.shutdown()
    except Exception:
        pass
    return rc


if __name__ == "__main__":
    sys.exit(main())
