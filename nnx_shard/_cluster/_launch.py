"""``nnx-shard launch``: N processes joined by jax.distributed, restarted on the survivors when one is lost.

The launcher is JAX's own multi-controller runtime with a supervisor around
it: it starts the processes with the variables :func:`initialize_distributed`
reads, watches them, and when one exits with an error or a signal it stops
the others (SIGTERM, then SIGKILL after a grace period) and starts the job
again on one process fewer, renumbered, up to ``max_restarts`` times. The
restarted job resumes (``resume="auto"``) from what the run left.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO

from nnx_shard._cluster._distributed import (
    COORDINATOR,
    FAILED_AT,
    LOST,
    NUM_PROCESSES,
    PREVIOUS_ID,
    PREVIOUS_PROCESSES,
    PROCESS_ID,
    RESTART,
    STOPPED_AT,
)
from nnx_shard.errors import ConfigError

POLL_S = 0.1
SETTLE_S = 1.0  # after the first failure, how long to look for the process that really died


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL`` or ``exited with status 3``.

    >>> describe_exit(-9), describe_exit(3)
    ('killed by SIGKILL', 'exited with status 3')
    """
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code: 128 + the signal for a signal."""
    return 128 - returncode if returncode < 0 else returncode


@dataclasses.dataclass
class Launcher:
    """Runs ``command`` as a job of ``processes`` processes; see :func:`launch`."""

    command: Sequence[str]
    processes: int
    devices_per_process: int | None = None
    min_processes: int = 1
    max_restarts: int = 0
    grace_s: float = 10.0
    job_dir: str | None = None
    out: IO[str] = dataclasses.field(default_factory=lambda: sys.stdout)

    def __post_init__(self) -> None:
        if self.processes < 1 or not 1 <= self.min_processes <= self.processes:
            raise ConfigError(
                f"launch needs 1 <= --min-processes <= --processes; got --processes {self.processes} "
                f"--min-processes {self.min_processes}."
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts is 0 or more; got {self.max_restarts}.")
        if not self.command:
            raise ConfigError("launch needs a command after `--`, e.g. `-- python train.py`.")
        self.job_dir = self.job_dir or tempfile.mkdtemp(prefix="nnx_shard_job_")
        self.failed_at = 0.0
        self.recovery: dict[str, str] = {}  # for the restarted job's `recovered` event

    def say(self, line: str) -> None:
        print(f"nnx-shard launch: {line}", file=self.out, flush=True)

    def _env(self, n: int, pid: int, port: int, restart: int, previous: int | None, lost: list[int]) -> dict:
        env = {
            **self.recovery,
            **os.environ,
            COORDINATOR: f"127.0.0.1:{port}",
            NUM_PROCESSES: str(n),
            PROCESS_ID: str(pid),
            RESTART: str(restart),
            PREVIOUS_ID: str(-1 if previous is None else previous),
            LOST: ",".join(map(str, lost)),
            # A restart does not pay the whole compile again.
            "JAX_COMPILATION_CACHE_DIR": os.environ.get(
                "JAX_COMPILATION_CACHE_DIR", os.path.join(str(self.job_dir), "compile_cache")
            ),
            "PYTHONUNBUFFERED": "1",
        }
        if self.devices_per_process is not None:  # simulated devices on a CPU; ignored by accelerators
            env["JAX_NUM_CPU_DEVICES"] = str(self.devices_per_process)
        return env

    def _start(
        self, n: int, restart: int, previous: list[int | None], lost: list[int]
    ) -> list[subprocess.Popen]:
        port = free_port()
        return [
            subprocess.Popen(list(self.command), env=self._env(n, i, port, restart, previous[i], lost))
            for i in range(n)
        ]

    def _first_failure(self, procs: list[subprocess.Popen]) -> tuple[int, int] | None:
        """Waits until all exit 0 (None) or one fails: ``(index, returncode)`` of the one that died first."""
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                self.failed_at = time.time()
                time.sleep(SETTLE_S)  # the survivors' own errors follow the death: prefer a signal
                codes = [p.poll() for p in procs]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                signalled = [(i, c) for i, c in failed if c < 0]
                return (signalled or failed)[0]
            if all(c == 0 for c in codes):
                return None
            time.sleep(POLL_S)

    def _stop(self, procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def run(self) -> int:
        n, restart, lost = self.processes, 0, []
        previous: list[int | None] = [None] * n
        devices = f" x {self.devices_per_process} devices" if self.devices_per_process else ""
        self.say(f"starting {n} process{'es' if n != 1 else ''}{devices}: {' '.join(self.command)}")
        while True:
            procs = self._start(n, restart, previous, lost)
            try:
                failure = self._first_failure(procs)
            except KeyboardInterrupt:
                self._stop(procs)
                raise
            if failure is None:
                self.say(f"job finished on {n} process{'es' if n != 1 else ''}")
                return 0
            index, code = failure
            self._stop(procs)
            survivors = n - 1
            self.recovery = {
                FAILED_AT: repr(self.failed_at),
                STOPPED_AT: repr(time.time()),
                PREVIOUS_PROCESSES: str(n),
            }
            what = f"process {index} {describe_exit(code)}"
            if restart >= self.max_restarts or survivors < self.min_processes:
                why = (
                    f"{self.max_restarts} restarts used"
                    if restart >= self.max_restarts
                    else f"{survivors} left, below --min-processes {self.min_processes}"
                )
                self.say(f"{what}; not restarting ({why}); exit status {exit_status(code)}")
                return exit_status(code)
            restart += 1
            lost = [index]
            previous = [i for i in range(n) if i != index]  # survivors keep their order, renumbered
            n = survivors
            self.say(f"{what}; restart {restart} on {n} process{'es' if n != 1 else ''}{devices}")


def launch(
    command: Sequence[str],
    processes: int,
    *,
    devices_per_process: int | None = None,
    min_processes: int = 1,
    max_restarts: int = 0,
    grace_s: float = 10.0,
) -> int:
    """Runs ``command`` in ``processes`` processes joined by ``jax.distributed``; returns the job's exit
    status.

    Each process gets ``NNX_SHARD_COORDINATOR`` (a free local port),
    ``NNX_SHARD_NUM_PROCESSES``, ``NNX_SHARD_PROCESS_ID``,
    ``NNX_SHARD_RESTART``, ``NNX_SHARD_PREVIOUS_ID`` and ``NNX_SHARD_LOST``
    (read by :func:`nnx_shard.initialize_distributed` and the Trainer),
    ``JAX_NUM_CPU_DEVICES`` when ``devices_per_process`` is given, and a job
    compilation cache. When a process fails, the others are stopped and the
    job starts again on the survivors (at least ``min_processes``), up to
    ``max_restarts`` times, with one line per event.

    >>> import sys
    >>> launch([sys.executable, "-c", "pass"], 2)
    nnx-shard launch: starting 2 processes: ...
    nnx-shard launch: job finished on 2 processes
    0
    """
    return Launcher(
        command,
        processes,
        devices_per_process=devices_per_process,
        min_processes=min_processes,
        max_restarts=max_restarts,
        grace_s=grace_s,
    ).run()
