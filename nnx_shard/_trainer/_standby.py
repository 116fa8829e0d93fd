"""Processes a resize left without devices: they hold no shard and run no step, and join what needs them all.

After :meth:`Trainer.resize` onto a mesh that leaves some processes out,
those processes are on standby: their ``train()`` runs no step. The first
process of the mesh (the leader) tells them, through JAX's coordination
service, when to join a save (Orbax's writes and the data position's gather
are collectives over every process) and when its ``train()`` call ended: at
which step, why, and where the data stopped. The processes of the mesh never
wait on the standby ones for anything else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from nnx_shard._cluster import DEADLINE_EXCEEDED, Keys, KeyValueStore
from nnx_shard._trainer import _data
from nnx_shard.errors import DistributedNotInitializedError, StandbyError

WAIT_MS = 3_600_000  # one blocking read of the coordination service; a standby process reads again after it


@dataclass
class Relay:
    """The leader's word to the standby processes of one mesh (``generation``: one per resize).

    Messages are numbered JSON values under ``nnx_shard/standby/<generation>/``: the leader writes them
    in order, each standby process reads them in order.
    """

    generation: int
    processes: Sequence[int]  # those holding devices of the mesh
    sent: int = 0
    read: int = 0

    @property
    def leader(self) -> bool:
        return jax.process_index() == self.processes[0]

    @property
    def standby(self) -> bool:
        """Whether this process holds no device of the mesh."""
        return jax.process_index() not in self.processes

    def send(self, message: dict[str, Any]) -> None:
        """(leader) The next message to every standby process."""
        key = f"{Keys.STANDBY}{self.generation}/{self.sent}"
        self.sent += 1
        KeyValueStore().set(key, json.dumps(message), overwrite=False)

    def receive(self) -> dict[str, Any]:
        """(standby) The leader's next message, waited for as long as it takes.

        Raises:
          StandbyError: the coordination service stopped answering (the leader's process is then gone too,
            or JAX ends this one first).
        """
        key = f"{Keys.STANDBY}{self.generation}/{self.read}"
        try:
            store = KeyValueStore()
            while True:
                try:
                    raw = store.get(key, WAIT_MS)
                    break
                except jax.errors.JaxRuntimeError as e:
                    if e.error_code != DEADLINE_EXCEEDED:
                        raise
        except (jax.errors.JaxRuntimeError, DistributedNotInitializedError) as e:
            raise StandbyError(
                f"process {jax.process_index()} is on standby (it holds no device of the mesh) and lost the "
                f"processes training: waiting for message {self.read} of resize {self.generation}, JAX's "
                f"coordination service answered {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}"
            ) from e
        self.read += 1
        return json.loads(raw)


class Relayed:
    """A standby process's stand-in for the leader's batches in a save: the leader's data position.

    An elastic iterator's position is global, so the standby process saves the same one; any other's is
    its own and stays None here.
    """

    def __init__(self, gather: bool, state: Any):
        self.resumable = gather  # as the leader's batches: it gathers the positions when they are resumable
        self._state = state

    def state(self) -> Any:
        return _data.decode_state(self._state)


def end_message(step: int, stop_reason: str | None, batches: _data.Batches | None, error: str | None) -> dict:
    """(leader) What the standby processes learn when a ``train()`` call ends."""
    elastic = batches is not None and batches.elastic and batches.resumable
    data = _data.encode_state(batches.state()) if elastic else None
    return {"do": "end", "step": step, "stop_reason": stop_reason, "data": data, "error": error}


def save_message(step: int, batches: Any, metrics: Any, force: bool) -> dict:
    """(leader) A save the standby processes join; the leader's data position goes with it when global."""
    resumable = batches is not None and batches.resumable
    elastic = resumable and batches.elastic
    return {
        "do": "save",
        "step": step,
        "metrics": metrics,
        "force": force,
        "gather": resumable,  # the leader gathers data positions: so must every process
        "data": _data.encode_state(batches.state()) if elastic else None,
    }
