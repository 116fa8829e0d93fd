"""Entry point of one worker process of a multi-process test (see tests/apps/multihost.py)."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

HEARTBEAT_S = 10
SHUTDOWN_S = 10
# Once its result is written, a process that has not left after this long is stuck in the
# runtime's teardown: it prints every thread's stack and exits with EXIT_HUNG (see WorkerResult).
EXIT_S = 45
EXIT_HUNG_MARK = "Timeout ("  # how faulthandler's dump begins


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
    faulthandler.dump_traceback_later(EXIT_S, exit=True, file=sys.stderr)
    # Leave together: a process that exits first breaks the others' collectives.
    try:
        jax.distributed.shutdown()
    except Exception:
        pass
    return rc


if __name__ == "__main__":
    sys.exit(main())
