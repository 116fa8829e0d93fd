"""ShardingPlan: which rule placed each leaf, its spec, and the bytes each device holds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from nnx_shard._base import Kind, format_bytes, format_table, parse_bytes
from nnx_shard._sharding._notes import Note, NoteKind


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where one leaf goes and why.

    Attributes:
      path: the leaf's ``/``-joined path.
      shape: its global shape (None for a leaf without one, which is skipped).
      dtype: its dtype name.
      spec: its PartitionSpec (None when skipped).
      rule_index: the strategy rule that placed it (None: scalar, skipped or unmatched).
      matched: the name the rule matched when not the path itself (the
        parameter path an optimizer or EMA leaf mirrors).
      total_bytes: bytes of the whole array.
      bytes_per_device: exact bytes on the fullest device.
      notes: why a leaf stayed replicated, and other soft findings.
      label: what the leaf is for, when known (a Trainer labels model
        parameters ``trainable`` or ``frozen``).

    >>> LeafPlacement("w", (4,), "float32", None, None, None, 16, 16).sharded
    False
    """

    path: str
    shape: tuple[int, ...] | None
    dtype: str
    spec: PartitionSpec | None
    rule_index: int | None
    matched: str | None
    total_bytes: int
    bytes_per_device: int
    notes: tuple[Note, ...] = ()
    label: str | None = None
    kind: Kind = Kind.STATE

    @classmethod
    def skipped(cls, leaf: Any) -> LeafPlacement:
        return cls(
            leaf.path, None, "-", None, None, None, 0, 0, (Note(NoteKind.SKIPPED, "skipped: no shape"),)
        )

    @property
    def sharded(self) -> bool:
        return self.spec is not None and any(e is not None for e in self.spec)


@dataclasses.dataclass
class ShardingPlan:
    """The result of :func:`nnx_shard.plan_sharding`, printable as a table.

    Attributes:
      mesh: the mesh placed on.
      leaves: one :class:`LeafPlacement` per leaf, in tree order.
      rules: the strategy as ``(regex, tactic text)`` pairs.
      unused_rules: indices of rules that matched no leaf (usually typos).
      shardings: the pytree of ``NamedSharding`` (None for skipped leaves).
      notes: findings about the plan as a whole (Explicit mesh axes that shard leaves).

    >>> import jax
    >>> from nnx_shard import create_mesh, plan_sharding
    >>> state = {"w": jax.ShapeDtypeStruct((64, 32), "float32"), "step": jax.ShapeDtypeStruct((), "int32")}
    >>> plan = plan_sharding(state, [("w", "shard_dim(axis='fsdp', dim=0)"), (".*", "replicate")],
    ...                      create_mesh((8,), ("fsdp",)))
    >>> plan.bytes_per_device, plan.sharded_bytes_per_device, plan.replicated_bytes_per_device
    (1028, 1024, 4)
    """

    mesh: Mesh
    leaves: list[LeafPlacement]
    rules: list[tuple[str, str]]
    unused_rules: list[int]
    shardings: Any = dataclasses.field(repr=False, default=None)
    notes: list[Note] = dataclasses.field(default_factory=list)

    def leaf(self, path: str) -> LeafPlacement:
        """The placement of the leaf with exactly this path."""
        for p in self.leaves:
            if p.path == path:
                return p
        raise KeyError(f"no leaf {path!r} in the plan; paths look like {self.leaves[0].path!r}.")

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole state, counted once."""
        return sum(p.total_bytes for p in self.leaves)

    @property
    def sharded_bytes_per_device(self) -> int:
        """Bytes of sharded leaves on the fullest device."""
        return sum(p.bytes_per_device for p in self.leaves if p.sharded)

    @property
    def replicated_bytes_per_device(self) -> int:
        """Bytes of replicated leaves, which every device holds whole."""
        return sum(p.bytes_per_device for p in self.leaves if not p.sharded)

    @property
    def bytes_per_device(self) -> int:
        """Exact bytes on the fullest device."""
        return self.sharded_bytes_per_device + self.replicated_bytes_per_device

    def bytes_by_label(self) -> dict[str, int]:
        """Bytes on the fullest device per leaf label (``trainable``, ``frozen``); unlabelled leaves left out.

        >>> import jax
        >>> from nnx_shard import create_mesh, plan_sharding
        >>> state = {"a": jax.ShapeDtypeStruct((64,), "float32"), "b": jax.ShapeDtypeStruct((8,), "float32")}
        >>> plan = plan_sharding(state, [(".*", "replicate")], create_mesh((8,), ("fsdp",)))
        >>> plan.with_labels({"a": "frozen", "b": "trainable"}).bytes_by_label()
        {'frozen': 256, 'trainable': 32}
        """
        out: dict[str, int] = {}
        for p in self.leaves:
            if p.label is not None:
                out[p.label] = out.get(p.label, 0) + p.bytes_per_device
        return out

    def with_labels(self, labels: Mapping[str, str]) -> ShardingPlan:
        """A copy with ``labels`` (``{path: label}``) set on those leaves."""
        leaves = [dataclasses.replace(p, label=labels.get(p.path, p.label)) for p in self.leaves]
        return dataclasses.replace(self, leaves=leaves)

    def plot(self, path: str, *, budget: int | str | None = None, top: int = 6) -> str:
        """Draws the plan into a PNG at ``path`` (1200x500 pixels) and returns ``path``: bytes on the fullest
        device split into model (trainable, frozen), optimizer and EMA against ``budget`` (bytes or
        ``"16GiB"``), and the ``top`` largest leaves' layouts over the mesh (one colour per block a device
        holds) with the rule that placed each. Needs matplotlib (``pip install 'nnx-shard[plot]'``).
        """
        from nnx_shard._sharding._plot import plot_plan

        limit = None if budget is None else parse_bytes(budget)
        return plot_plan(self, path, budget=limit, top=top)

    def summary(self) -> str:
        """A few lines: leaves, bytes per device, rules and notes."""
        n = len(self.leaves)
        sharded = sum(p.sharded for p in self.leaves)
        skipped = sum(p.spec is None for p in self.leaves)
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        lines = [
            f"mesh ({mesh}), {self.mesh.devices.size} devices; {n} leaves: {sharded} sharded, "
            f"{n - sharded - skipped} replicated, {skipped} without a shape",
            f"state {format_bytes(self.total_bytes)}; per device "
            f"{format_bytes(self.bytes_per_device)} (sharded "
            f"{format_bytes(self.sharded_bytes_per_device)} + replicated "
            f"{format_bytes(self.replicated_bytes_per_device)})",
        ]
        labelled = self.bytes_by_label()
        if labelled:
            lines.append(
                "per device by label: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in labelled.items())
            )
            counts = {k: sum(math.prod(p.shape or ()) for p in self.leaves if p.label == k) for k in labelled}
            total = max(sum(counts.values()), 1)
            lines.append(
                "parameters by label: "
                + ", ".join(f"{k} {v:,} ({100 * v / total:.3g}%)" for k, v in counts.items())
            )
        counts = [0] * len(self.rules)
        for p in self.leaves:
            if p.rule_index is not None:
                counts[p.rule_index] += 1
        for i, (pattern, tactic) in enumerate(self.rules):
            flag = "  <- matched nothing: typo?" if i in self.unused_rules else ""
            lines.append(f"  rule {i}: ({pattern!r}, {tactic!r}) placed {counts[i]} leaves{flag}")
        noted = sum(1 for p in self.leaves if any(n.kind.level is not None for n in p.notes))
        if noted:
            lines.append(f"  {noted} leaves carry notes (left replicated); see the table")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def table(self, max_rows: int | None = None) -> str:
        """One row per leaf: path, shape, dtype, spec, rule, bytes per device, notes (``max_rows`` 0 or None:
        all)."""
        max_rows = max_rows or None
        rows = [("path", "shape", "dtype", "spec", "rule", "per device", "notes")]
        shown = self.leaves if max_rows is None else self.leaves[:max_rows]
        for p in shown:
            rule = "-" if p.rule_index is None else str(p.rule_index)
            if p.matched:
                rule += f" (as {p.matched})"
            spec = "-" if p.spec is None else str(tuple(p.spec)).replace("'", "")
            rows.append(
                (
                    p.path,
                    "-" if p.shape is None else "x".join(map(str, p.shape)) or "()",
                    p.dtype,
                    spec,
                    rule,
                    format_bytes(p.bytes_per_device),
                    "; ".join([p.label] * (p.label is not None) + list(p.notes)),
                )
            )
        lines = format_table(rows).splitlines()
        if max_rows is not None and len(self.leaves) > max_rows:
            lines.append(f"... {len(self.leaves) - max_rows} more leaves")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (for ``nnx-shard plan --json``)."""
        return {
            "mesh": dict(self.mesh.shape),
            "rules": [list(r) for r in self.rules],
            "unused_rules": self.unused_rules,
            "total_bytes": self.total_bytes,
            "bytes_per_device": self.bytes_per_device,
            "sharded_bytes_per_device": self.sharded_bytes_per_device,
            "replicated_bytes_per_device": self.replicated_bytes_per_device,
            **({"bytes_by_label": self.bytes_by_label()} if self.bytes_by_label() else {}),
            "leaves": [
                {
                    "path": p.path,
                    "shape": p.shape,
                    "dtype": p.dtype,
                    "spec": None
                    if p.spec is None
                    else [e if not isinstance(e, tuple) else list(e) for e in p.spec],
                    "rule": p.rule_index,
                    "matched": p.matched,
                    "bytes_per_device": p.bytes_per_device,
                    "notes": list(p.notes),
                    **({"label": p.label} if p.label is not None else {}),
                }
                for p in self.leaves
            ],
        }

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()
