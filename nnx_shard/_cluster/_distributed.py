"""Joining JAX's distributed runtime from the environment ``nnx-shard launch`` sets, with short failure
detection."""

from __future__ import annotations

import dataclasses
import os

import jax

from nnx_shard.errors import ConfigError

COORDINATOR = "NNX_SHARD_COORDINATOR"
NUM_PROCESSES = "NNX_SHARD_NUM_PROCESSES"
PROCESS_ID = "NNX_SHARD_PROCESS_ID"
RESTART = "NNX_SHARD_RESTART"
PREVIOUS_ID = "NNX_SHARD_PREVIOUS_ID"  # this process's id before the last restart (-1: new)
LOST = "NNX_SHARD_LOST"  # comma-separated ids, in the previous run's numbering, of the processes lost
FAILED_AT = "NNX_SHARD_FAILED_AT"  # epoch seconds: when the launcher saw the process die
STOPPED_AT = "NNX_SHARD_STOPPED_AT"  # epoch seconds: when the failed run's last process had stopped
PREVIOUS_PROCESSES = "NNX_SHARD_PREVIOUS_PROCESSES"  # processes in the run before this restart


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process stands in a job started by ``nnx-shard launch``.

    Attributes:
      coordinator: ``host:port`` of process 0's coordination service.
      num_processes: processes in this run of the job.
      process_id: this process's id in this run.
      restart: how many times the job was restarted (0 at first).
      previous_id: this process's id in the previous run (None at first, or for a new process).
      lost: ids, in the previous run's numbering, of the processes that were lost.
    """

    coordinator: str
    num_processes: int
    process_id: int
    restart: int = 0
    previous_id: int | None = None
    lost: tuple[int, ...] = ()


def _int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise ConfigError(f"{name} is not set; it comes with {COORDINATOR} (set by nnx-shard launch).")
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer; got {text!r}.") from None


def launch_info() -> LaunchInfo | None:
    """The launcher's variables as a :class:`LaunchInfo`; None when this process was not launched by it.

    >>> launch_info() is None  # not under nnx-shard launch
    True
    """
    coordinator = os.environ.get(COORDINATOR)
    if not coordinator:
        return None
    n, pid = _int(NUM_PROCESSES), _int(PROCESS_ID)
    if not 0 <= pid < n:
        raise ConfigError(f"{PROCESS_ID}={pid} is not a process of {NUM_PROCESSES}={n}.")
    previous = _int(PREVIOUS_ID, -1)
    lost_text = os.environ.get(LOST, "").strip()
    try:
        lost = tuple(int(x) for x in lost_text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{LOST} is a comma-separated list of process ids; got {lost_text!r}.") from None
    return LaunchInfo(coordinator, n, pid, _int(RESTART, 0), None if previous < 0 else previous, lost)


def initialize_distributed(
    *, heartbeat_timeout: int = 10, shutdown_timeout: int = 30, initialization_timeout: int = 120
) -> LaunchInfo | None:
    """Joins ``jax.distributed`` as ``nnx-shard launch`` asked; does nothing outside a launched job.

    Call it first thing in a script without a Trainer (the Trainer calls it
    itself): JAX must not have started a backend yet. A peer that dies is
    noticed after ``heartbeat_timeout`` seconds, not JAX's default 100, so the
    survivors fail fast and the launcher can restart them.

    Returns:
      The :class:`LaunchInfo`, or None when the process was not launched (a
      single process: nothing to join).

    >>> initialize_distributed() is None  # a plain `python script.py`
    True
    """
    info = launch_info()
    if info is None or jax.distributed.is_initialized():
        return info
    try:
        jax.distributed.initialize(
            info.coordinator,
            info.num_processes,
            info.process_id,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
            shutdown_timeout_seconds=shutdown_timeout,
        )
    except RuntimeError as e:
        raise ConfigError(
            f"could not join the job as process {info.process_id} of {info.num_processes} at "
            f"{info.coordinator}: {e}. Call nnx_shard.initialize_distributed() (or build the Trainer) "
            f"before anything else uses JAX."
        ) from e
    return info
