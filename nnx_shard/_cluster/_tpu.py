"""TPU pods we do not have: their devices, compile-only, and what a compiled program holds and sends on each
chip.

With ``libtpu`` installed (``pip install 'nnx-shard[tpu]'``), JAX describes any
TPU topology (``jax.experimental.topologies``) and XLA's TPU compiler compiles
for it ahead of time, without a chip, as MaxText's ``train_compile`` does.
:func:`compile_program` turns one such compile into a :class:`CompileReport`:
XLA's ``memory_analysis()`` and ``cost_analysis()`` per device, the
collectives in the compiled HLO, and the chip's HBM. A program that does not
fit is refused by the TPU compiler itself (``RESOURCE_EXHAUSTED``); the report
says ``fits: no`` with the compiler's figures instead of raising.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from nnx_shard._base import format_bytes
from nnx_shard._sharding import ShardingPlan
from nnx_shard.errors import CompileError, TopologyError

GIB = 2**30
# HBM per chip (the device JAX gives for each; v4 as a megacore chip)
HBM = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,
    "TPU v5": 95 * GIB,
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,
}
KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
ACCELERATOR = {
    "v4": "v4-8",
    "v5e": "v5litepod-8",
    "v5p": "v5p-8",
    "v6e": "v6e-8",
}  # only quiets libtpu's start
_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HLO_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_HLO_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "s8": 8,
    "u8": 8,
    "s16": 16,
}
_BITS.update({"u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f8e4m3fn": 8, "f8e5m2": 8, "c64": 64})


def tpu_devices(topology: str, *, slices: int = 1) -> list[Any]:
    """The devices of a TPU topology such as ``"v5e:16x16"`` or ``"v5p:4x4x8"``, for compiling only.

    ``slices`` > 1 gives that many slices over DCN (each device carries its
    ``slice_index``, so :func:`nnx_shard.create_mesh` lays out a hybrid
    ICI/DCN mesh). Nothing runs on them: lower and compile (see
    :meth:`nnx_shard.Trainer.compile_report`).

    Raises:
      TopologyError: libtpu is not installed, or it does not know the topology.

    >>> devices = tpu_devices("v5e:2x4")  # doctest: +SKIP
    >>> len(devices), devices[0].device_kind  # doctest: +SKIP
    (8, 'TPU v5 lite')
    """
    m = _TOPOLOGY.match(topology.strip())
    if m is None:
        raise TopologyError(
            f"TPU topology {topology!r} is not one of the forms v4:AxBxC, v5e:AxB, v5p:AxBxC, v6e:AxB "
            f"(e.g. 'v5e:16x16', 'v5p:4x4x8', 'v4:2x2x2', 'v6e:8x8')."
        )
    if not isinstance(slices, int) or slices < 1:
        raise TopologyError(f"slices is a whole number >= 1; got {slices!r}.")
    if (
        jax.default_backend() != "tpu"
    ):  # not on a TPU VM: libtpu must not look for one (nor print that it did not)
        for name, value in (
            ("TPU_SKIP_MDS_QUERY", "1"),
            ("TPU_WORKER_HOSTNAMES", "localhost"),
            ("TPU_ACCELERATOR_TYPE", ACCELERATOR[m.group(1)]),
            ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),  # compiling only: no chip to keep to one process
        ):
            os.environ.setdefault(name, value)
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise TopologyError(
            f"compiling for {topology} needs libtpu, which is not installed: pip install 'nnx-shard[tpu]' "
            f"(jax[tpu] at the installed jax version, {jax.__version__})."
        ) from e
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {"num_slices": slices} if slices > 1 else {}
    if m.group(1) == "v4":
        kwargs["chip_config_name"] = "megacore"  # one device per chip, as on a v4 VM
    try:
        return list(topologies.get_topology_desc(topology.strip(), "tpu", **kwargs).devices)
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError: INVALID_ARGUMENT from libtpu
        raise TopologyError(
            f"libtpu does not make TPU topology {topology!r}{f' x {slices} slices' if slices > 1 else ''}: "
            f"{str(e).splitlines()[0]}. Known chips: {', '.join(KINDS)}; each side a multiple of the "
            f"chips per host (2x2 on v5e and v6e, 2x2x1 on v4 and v5p)."
        ) from e


def hbm_bytes(device: Any) -> int | None:
    """The memory of ``device``'s chip: the TPU table above, else what the backend reports (None on a CPU)."""
    if device.device_kind in HBM:
        return HBM[device.device_kind]
    try:
        stats = device.memory_stats()
    except (RuntimeError, NotImplementedError):  # compile-only devices and some backends have none
        stats = None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": output bytes per device}}`` of the collectives in compiled HLO text.

    >>> collectives("%ar = f32[1024,2]{1,0} all-reduce(f32[1024,2] %x), replica_groups={}")
    {'all-reduce': {'count': 1, 'bytes': 8192}}
    """
    out: dict[str, dict[str, int]] = {}
    for line in hlo.splitlines():
        m = _HLO_OP.search(line)
        if m is None:
            continue
        shape, kind, start = m.group(1), m.group(2), m.group(3)
        arrays = _HLO_ARRAY.findall(shape)
        if start and kind in ("all-gather", "collective-permute", "all-to-all") and len(arrays) % 2 == 0:
            arrays = arrays[len(arrays) // 2 :]  # an async start holds (operands, results): count the results
        nbytes = 0
        for dtype, dims in arrays:
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            nbytes += count * _BITS.get(dtype, 32) // 8
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


@dataclasses.dataclass
class CompileReport:
    """What a program compiled for ``devices`` holds and sends on each device, and whether it fits.

    Attributes:
      device_kind: the chip (``TPU v5 lite``), and ``devices`` how many.
      argument_bytes, output_bytes, temp_bytes: per device, from XLA's ``memory_analysis()``.
      peak_bytes: arguments + outputs - donated aliases + temporaries; from the compiler's
        message when it refused the program (None when it gave none).
      hbm_bytes: the chip's memory (None when unknown), and ``fits`` whether the peak is within it.
      state_bytes: the training state's bytes on the fullest device, from the sharding plan;
        ``batch_bytes`` the batch's (both are in ``argument_bytes``).
      flops: per step, from XLA's ``cost_analysis()``.
      collectives: ``{kind: {"count", "bytes"}}`` in the compiled program.
      compile_seconds: lowering and compiling.
      error: the compiler's message when it refused the program.
      largest: the largest state arrays per device, with the rule that placed each (when it does not fit).
    """

    device_kind: str
    devices: int
    hbm_bytes: int | None
    peak_bytes: int | None
    fits: bool | None
    compile_seconds: float
    argument_bytes: int | None = None  # None when the compiler refused the program
    output_bytes: int | None = None
    temp_bytes: int | None = None
    flops: float | None = None
    collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    state_bytes: int | None = None
    batch_bytes: int | None = None
    error: str | None = None
    largest: list[str] = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """The report as lines: the chip, its HBM, each figure, the headroom and ``fits: yes`` or ``fits:
        no``."""
        f = lambda n: "-" if n is None else format_bytes(n)
        lines = [f"{self.devices} x {self.device_kind}, HBM {f(self.hbm_bytes)} per chip"]
        for name in (
            "argument_bytes",
            "output_bytes",
            "temp_bytes",
            "peak_bytes",
            "state_bytes",
            "batch_bytes",
        ):
            lines.append(f"  {name.replace('_', ' ')} per chip: {f(getattr(self, name))}")
        if self.peak_bytes is not None and self.hbm_bytes is not None:
            room = self.hbm_bytes - self.peak_bytes
            lines.append(f"  headroom: {f(room)}" if room >= 0 else f"  short by: {f(-room)}")
        if self.flops is not None:
            lines.append(f"  flops per step (per chip): {self.flops:.3e}")
        for kind, c in sorted(self.collectives.items()):
            lines.append(f"  {kind}: {c['count']} ops, {f(c['bytes'])} per chip")
        lines.append(f"  compiled in {self.compile_seconds:.1f} s")
        lines.append(f"fits: {'unknown' if self.fits is None else 'yes' if self.fits else 'no'}")
        if self.error:
            lines.append(f"  the compiler: {self.error}")
        lines.extend(f"  {row}" for row in self.largest)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_REQUIRED = re.compile(
    r"total memory required .*?\(([\d.]+)([KMGT])\).*?available HBM \(([\d.]+)([KMGT])\)", re.S
)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_program(
    fn: Callable[..., Any],
    args: Sequence[Any],
    devices: Sequence[Any],
    *,
    plan: ShardingPlan | None = None,
    **jit_kwargs: Any,
) -> CompileReport:
    """Lowers and compiles ``jax.jit(fn, **jit_kwargs)`` for abstract ``args`` and reports it (never raises
    for a program the compiler refuses for memory: ``fits`` is then False)."""
    device = devices[0]
    start = time.perf_counter()
    hbm = hbm_bytes(device)
    base = {"device_kind": device.device_kind, "devices": len(devices)}
    state = plan.bytes_per_device if plan is not None else None
    try:
        compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    except (RuntimeError, ValueError) as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED and the like
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            first = text.splitlines()[0] if text else type(e).__name__
            raise CompileError(
                f"XLA could not compile the program for {len(devices)} x {device.device_kind}: {first}"
            ) from e
        m = _REQUIRED.search(text)
        peak = int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None
        hbm = int(float(m.group(3)) * _UNITS[m.group(4)]) if m else hbm
        return CompileReport(
            **base,
            hbm_bytes=hbm,
            peak_bytes=peak,
            fits=False,
            compile_seconds=time.perf_counter() - start,
            state_bytes=state,
            error=next((line for line in text.splitlines() if "memory" in line.lower()), text[:300]),
            largest=_largest(plan),
        )
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    args_b, out_b = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    temp_b, alias_b = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
    peak = args_b + out_b - alias_b + temp_b
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    flops = float(cost["flops"]) if isinstance(cost, dict) and "flops" in cost else None
    fits = None if hbm is None else peak <= hbm
    return CompileReport(
        **base,
        hbm_bytes=hbm,
        argument_bytes=args_b,
        output_bytes=out_b,
        temp_bytes=temp_b,
        peak_bytes=peak,
        fits=fits,
        flops=flops,
        collectives=collectives(compiled.as_text()),
        compile_seconds=seconds,
        state_bytes=state,
        largest=[] if fits or fits is None else _largest(plan),
    )


def _largest(plan: ShardingPlan | None, n: int = 5) -> list[str]:
    if plan is None:
        return []
    rows = sorted(plan.leaves, key=lambda p: -p.bytes_per_device)[:n]
    out = ["largest arrays per chip:"]
    for p in rows:
        rule = "no rule" if p.rule_index is None else f"rule {p.rule_index} {plan.rules[p.rule_index]}"
        out.append(f"  {p.path} {p.shape} {format_bytes(p.bytes_per_device)} ({rule})")
    return out
