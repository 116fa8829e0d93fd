"""Shared helpers for the benchmarks: simulated devices, peak RSS, machine description, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
from pathlib import Path


def simulate_devices(n: int = 8) -> None:
    """Asks JAX for ``n`` CPU devices; call before anything touches a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine() -> dict[str, object]:
    import jax

    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def write_json(result: dict[str, object], out: str | None) -> None:
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
