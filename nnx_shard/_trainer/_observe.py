"""What a training run shows: a progress bar on a terminal, plain lines elsewhere, metrics.jsonl, TensorBoard,
events."""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from nnx_shard._base import flatten_with_paths, is_variable, storage

logger = logging.getLogger("nnx_shard")


def injected_learning_rate(optimizer: nnx.Optimizer) -> Any:
    """The learning rate an ``optax.inject_hyperparams`` transform holds in the optimizer state, if any."""
    for path, leaf in flatten_with_paths(optimizer.opt_state)[0]:
        if "hyperparams" in path.split("/") and path.endswith("learning_rate"):
            return leaf.get_value() if is_variable(leaf) else leaf
    return None


# Shown first, in this order, with these names; other metrics follow.
_FIRST = (("loss", "loss"), ("learning_rate", "lr"), ("grad_norm", "grad_norm"))


def _number(v: float) -> str:
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


def _rate(v: float, unit: str) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.1f}{suffix} {unit}/s"
    return f"{v:.1f} {unit}/s"


def format_line(record: dict[str, float], end: int | None = None) -> str:
    """``step 100/2000 | loss 2.3456 | lr 3.000e-04 | grad_norm 1.2340 | 12.3 steps/s | ...``.

    >>> format_line({"step": 10, "loss": 0.5, "steps_per_s": 4.0, "examples_per_s": 512.0}, 100)
    'step 10/100 | loss 0.5000 | 4.0 steps/s | 512.0 examples/s'
    >>> format_line({"step": 10, "eval_loss": 1.25, "eval_weights": "ema"})  # which weights were evaluated
    'step 10 | eval_loss (ema) 1.2500'
    """
    weights = record.get("eval_weights")
    record = {
        (f"{k} ({weights})" if weights and k.startswith("eval_") else k): v
        for k, v in record.items()
        if k != "eval_weights"
    }
    parts = [f"step {int(record['step'])}" + (f"/{end}" if end else "")]
    shown = {"step", "steps_per_s", "examples_per_s", "tokens_per_s"}
    for key, name in _FIRST:
        if key in record:
            parts.append(f"{name} {_number(record[key])}")
            shown.add(key)
    parts += [
        f"{k} {_number(v)}" for k, v in record.items() if k not in shown and isinstance(v, (int, float))
    ]
    for key, unit in (("steps_per_s", "steps"), ("examples_per_s", "examples"), ("tokens_per_s", "tokens")):
        if key in record:
            parts.append(_rate(record[key], unit))
    return " | ".join(parts)


class Observer:
    """Sends records and events to the terminal or stdout, ``metrics.jsonl`` and TensorBoard (from the
    mesh's first process: see :meth:`write_from`).

    In a bucket workdir (``gs://...``), whose objects cannot be appended to,
    ``metrics.jsonl`` is written whole every ``FLUSH_S`` seconds and at the
    end of each ``train()`` call, however it ended (a crash loses the lines
    since), and
    TensorBoard's event file, written to a local temporary folder, is
    uploaded whole at the same times.

    Args:
      workdir: where ``metrics.jsonl`` and ``tensorboard/`` go (None: nowhere).
      progress: ``"auto"`` (a bar when stderr is a terminal, lines otherwise),
        ``"bar"``, ``"lines"`` or ``"off"``.
      tensorboard: write TensorBoard events when tensorboardX is installed.
    """

    FLUSH_S = 10.0  # seconds between writes of metrics.jsonl to a bucket

    def __init__(self, workdir: str | None, progress: str, tensorboard: bool = True):
        self.main = jax.process_index() == 0
        self.metrics_path = storage.location(workdir) / "metrics.jsonl" if workdir else None
        self._in_bucket = self.metrics_path is not None and storage.is_uri(self.metrics_path)
        self._unwritten: list[str] = []  # lines a bucket's metrics.jsonl does not hold yet
        self._written: bytes | None = None  # what it holds (read once, before the first write)
        self._written_at = time.monotonic()
        self._staging: str | None = None  # a bucket's TensorBoard files, written here first
        self.progress = progress
        self.use_tensorboard = tensorboard
        self._bar: Any = None
        self._writer: Any = None
        self._end: int | None = None
        self.mode = "lines"  # "bar", "lines" or "off", chosen by start(); events before it are lines
        self.timings: collections.Counter[str] = collections.Counter()  # seconds per event name

    def write_from(self, writes: bool) -> None:
        """Whether this process writes (the first process of the mesh: process 0, unless a resize left it out,
        when the first process that trains writes until it is back). Takes effect at the next ``train()``."""
        if self.main and not writes:
            self.close()
        self.main = writes

    def start(self, step: int, end: int) -> None:
        """Opens the bar (on a terminal) for a ``train()`` call from ``step`` to ``end``."""
        self._end = end
        mode = "bar" if self.progress == "on" else self.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if self.main else "off"
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=end, initial=step, desc="train", dynamic_ncols=True)

    def record(self, record: dict[str, float]) -> None:
        """A logged step: the bar's postfix or one stdout line, a JSON line, TensorBoard scalars."""
        if not self.main:
            return
        if self._bar is not None:
            self._bar.update(int(record["step"]) - self._bar.n)
            shown = {k: round(v, 4) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            self._bar.set_postfix(shown, refresh=False)
        elif self.mode == "lines":
            print(format_line(record, self._end), flush=True)
        self._append({"time": time.time(), **record})
        writer = self._tensorboard()
        if writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(
                        key, value, int(record["step"])
                    )  # written out every 10 s and at the end

    def announce(self, level: int, text: str) -> None:
        """A line said once at the start: logged at ``level``, and printed by process 0 unless progress is
        off."""
        logger.log(level, "%s", text)
        if self.main and self.progress != "off":
            print(text, flush=True)

    def event(self, name: str, seconds: float, step: int, **fields: Any) -> None:
        """Where wall time went (compile, save, restore, resize, eval): a line, a JSON line, a scalar.

        Its seconds add up in :attr:`timings` on every process.
        """
        self.timings[name] += seconds
        logger.info("%s took %.3f s at step %d %s", name, seconds, step, fields or "")
        if not self.main:
            return
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        text = f"event {name}: {seconds:.3f} s at step {step}{extra}"
        if self._bar is not None:
            self._bar.write(text)
        elif self.mode == "lines":
            print(text, flush=True)
        self._append(
            {"time": time.time(), "event": name, "seconds": round(seconds, 6), "step": step, **fields}
        )
        writer = self._tensorboard()
        if writer is not None:
            writer.add_scalar(f"time/{name}_s", seconds, step)

    def _append(self, record: dict[str, Any]) -> None:
        if self.metrics_path is None:
            return
        line = json.dumps(record, default=str) + "\n"
        if self._in_bucket:
            self._unwritten.append(line)
            if time.monotonic() - self._written_at > self.FLUSH_S:
                self._write_bucket()
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(line)

    def _write_bucket(self) -> None:
        """Brings a bucket workdir up to date: ``metrics.jsonl`` written whole (what an earlier run left, then
        every line since), and TensorBoard's event files uploaded from their local staging folder."""
        if self.metrics_path is None or not self._in_bucket:
            return
        if self._unwritten:
            if self._written is None:
                self._written = self.metrics_path.read_bytes() if self.metrics_path.exists() else b""
            data = self._written + "".join(self._unwritten).encode()
            storage.write_bytes(self.metrics_path, data)
            self._written, self._unwritten = data, []
        if self._writer:
            self._writer.flush()
        if self._staging is not None:
            for f in sorted(Path(self._staging).iterdir()):
                storage.write_bytes(self.metrics_path.parent / "tensorboard" / f.name, f.read_bytes())
        self._written_at = time.monotonic()

    def _tensorboard(self) -> Any:
        if self._writer is None:
            self._writer = False
            if self.use_tensorboard and self.metrics_path is not None and self.main:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError:
                    return None
                folder = os.fspath(self.metrics_path.parent / "tensorboard")
                if self._in_bucket:  # written here, uploaded whole with metrics.jsonl
                    self._staging = folder = tempfile.mkdtemp(prefix="nnx_shard-tensorboard-")
                    weakref.finalize(self, shutil.rmtree, folder, True)
                self._writer = SummaryWriter(folder, flush_secs=int(self.FLUSH_S))
                weakref.finalize(self, self._writer.close)  # kept open across train() calls: closed with us
        return self._writer or None

    def finish(self) -> None:
        """The end of a ``train()`` call: closes the bar and flushes TensorBoard's event file to disk (to a
        bucket workdir, with ``metrics.jsonl``).

        The file stays open for the next call (one file per Trainer): opening and closing a writer costs
        milliseconds a call, which a loop of short ``train()`` calls would pay each time.
        """
        self._close_bar()
        if self._in_bucket:
            self._write_bucket()
        elif self._writer:
            self._writer.flush()

    def close(self) -> None:
        """Closes the bar and the event file, flushed (a later record opens a new one)."""
        self._close_bar()
        if self._writer:
            self._writer.close()
        self._write_bucket()
        self._writer = None
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
