"""A Trainer across resizes that change which processes hold the mesh: standby processes and the data's rows.

:class:`Resizing` is the part of :meth:`nnx_shard.Trainer.resize` that
outlives the call, the way :class:`TrainingLoop` is ``train()``'s: the relay
to the processes a mesh leaves out (None while every process holds devices),
the last mesh with every process (saves are written there), and the global
batch's rows before a resize that moved the data (the first batch after it
must have as many).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from nnx_shard._base import mesh_processes
from nnx_shard._cluster import data_shard
from nnx_shard._trainer import _standby
from nnx_shard._trainer._observe import Observer
from nnx_shard.errors import BatchStructureError, MeshError, StandbyError

Records = list[dict[str, float]]


class Resizing:
    """What a Trainer keeps between resizes; its methods are the Trainer's steps that depend on them."""

    def __init__(self) -> None:
        self.relay: _standby.Relay | None = None  # while the mesh leaves processes out
        self.whole_mesh: Mesh | None = None  # the last mesh with a device on every process
        self.resizes = 0
        self.in_train = False  # the leader is inside train(): its saves are announced
        self.rows_before: int | None = None  # the global batch's rows before a resize that moved the data
        self.rows = 0  # of the last global batch stepped on

    @property
    def standby(self) -> bool:
        """Whether this process holds no device of the mesh."""
        return self.relay is not None and self.relay.standby

    @property
    def leader(self) -> bool:
        """Whether this process tells the standby ones (the first process of a mesh that leaves some out)."""
        return self.relay is not None and self.relay.leader

    def moved(self, old: Mesh, new: Mesh, data_moved: bool, observer: Observer) -> list[int]:
        """After the state moved from ``old`` to ``new``: the processes holding ``new``. Its first process
        writes the run's records from now on."""
        processes = mesh_processes(new)
        observer.write_from(jax.process_index() == processes[0])
        self.resizes += 1
        left_out = len(processes) < jax.process_count()
        self.relay = _standby.Relay(self.resizes, processes) if left_out else None
        if len(mesh_processes(old)) == jax.process_count():
            self.whole_mesh = old
        if not left_out:
            self.whole_mesh = new
        if data_moved and self.rows:
            self.rows_before = self.rows  # the next global batch must have as many rows
        return processes

    def refuse(self, what: str, mesh: Mesh) -> None:
        """MeshError when this process is on standby: ``what`` needs a device of the mesh."""
        if self.standby:
            raise MeshError(
                f"cannot {what} on process {jax.process_index()}: it holds no device of the mesh since the "
                f"resize onto {', '.join(f'{k}={v}' for k, v in mesh.shape.items())} (processes "
                f"{list(self.relay.processes)}). Call train() on every process: this one waits there and "
                f"joins the saves; or resize back onto a mesh with its devices."
            )

    def check_rows(self, rows: int, mesh: Mesh) -> None:
        """Refuses the first global batch after a resize that moved the data when its ``rows`` changed (on
        every step: the shard is worked out only for the error)."""
        self.rows = rows
        if self.rows_before is None:
            return
        rows, self.rows_before = self.rows_before, None
        shard = data_shard(mesh)
        if self.rows != rows and shard is not None:
            raise BatchStructureError(
                f"the global batch has {self.rows} rows after the resize and had {rows} before it: the data "
                "is "
                f"still sliced for the processes before it, and the new mesh reads {shard.count} data "
                f"shard{'s' if shard.count != 1 else ''} (this process reads shard {shard.index}). Slice "
                "each "
                f"step's batch by trainer.data_shard (index, count) instead of jax.process_index() and "
                "jax.process_count(), or read with grain.experimental.ElasticIterator, which the Trainer "
                "moves "
                f"onto the new shards."
            )

    def lead(self, run: Callable[[], Records], loop: Any, step: Callable[[], int]) -> Records:
        """(leader) ``run`` (the loop of a ``train()`` call), then the standby processes told how it ended."""
        error = None
        self.in_train = True
        try:
            return run()
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.in_train = False
            self.relay.send(_standby.end_message(step(), loop.stop_reason, loop.batches, error))

    def announce_save(self, step: int, batches: Any, metrics: Any, force: bool) -> None:
        """(leader, inside ``train()``) A save the standby processes join: every process writes."""
        if self.in_train and self.relay is not None:
            self.relay.send(_standby.save_message(step, batches, metrics, force))

    def follow(self, save: Callable[[int, Any, Any, bool], Any]) -> dict[str, Any]:
        """(standby) Joins the leader's saves, ``save(step, batches, metrics, force)``, until its ``train()``
        call ends; returns how it ended (``step``, ``stop_reason``, ``data``: an elastic position or None)."""
        while True:
            message = self.relay.receive()
            if message["do"] != "save":
                return message
            relayed = _standby.Relayed(message["gather"], message["data"])
            save(int(message["step"]), relayed, message["metrics"], message["force"])

    def raise_if_failed(self, end: dict[str, Any]) -> None:
        """(standby) StandbyError when the leader's ``train()`` call raised."""
        if end["error"] is not None:
            raise StandbyError(
                f"the processes training on the mesh ({list(self.relay.processes)}) raised at step "
                f"{end['step']}: {end['error']}; process {jax.process_index()} was on standby there."
            )

    def writable(self, hooks: Any, mesh: Mesh) -> tuple[dict[str, Any], Mesh]:
        """The states a save writes and their mesh: Orbax writes arrays that every process holds, so while
        the mesh leaves processes out, a copy on the last mesh that had them all."""
        if self.relay is None:
            return hooks.states(), mesh
        return hooks.states_on(self.whole_mesh), self.whole_mesh
