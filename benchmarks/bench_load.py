"""Pretrained safetensors weights into a sharded model: ns.load_safetensors against reading whole tensors.

Question: what does streaming each shard's bytes cost, and what does it save? A Llama-style
stack (``--layers`` decoder blocks of q/k/v/o and a gated MLP in Hugging Face's naming and
(out, in) layout, float32) is written to safetensors files once. Then, each in a fresh process
so that its peak RSS is its own, on 8 simulated devices with fsdp:8:

- ``stream``: ``ns.load_safetensors`` into the sharded model (transposes and the implied
  reshape of q/k/v into (embed, heads, head_dim) kernels applied per shard);
- ``whole``: the baseline a user would write: ``safetensors.numpy.load_file`` of every file,
  the transposes and reshapes in NumPy, then ``ns.place_like_target`` onto the same shardings;
- ``read``: the files' raw read rate (every byte read once into one reused buffer).

Reported: seconds, GB/s, the ratio of the stream's rate to the raw read rate (goal >= 0.70),
the memory each load adds against the goal (the loaded state + the largest shard + 256 MiB):
the peak of anonymous resident memory, sampled every 2 ms (the files' pages that safetensors
maps are page cache, which the kernel can drop), beside the plain peak-RSS growth; bytes read
against bytes needed.

    python benchmarks/bench_load.py [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, write_json

HERE = Path(__file__).resolve().parent


def sizes(smoke: bool) -> dict[str, int]:
    if smoke:
        return {"layers": 2, "embed": 128, "heads": 8, "mlp": 256}
    return {"layers": 8, "embed": 1024, "heads": 16, "mlp": 2816}  # 8 x 12.7M params: 0.41 GB in float32


def rules() -> list:
    p = r"model\.layers\.(\d+)\."
    return [
        (p + r"self_attn\.(q|k|v)_proj\.weight", r"layers/\1/\2/kernel", "T"),
        (p + r"self_attn\.o_proj\.weight", r"layers/\1/o/kernel", "T"),
        (p + r"mlp\.(gate|up|down)_proj\.weight", r"layers/\1/\2/kernel", "T"),
    ]


def model(s: dict[str, int]):
    from flax import nnx

    e, h = s["embed"], s["heads"]

    class Block(nnx.Module):
        def __init__(self, rngs):
            for n in "qkv":
                setattr(self, n, nnx.LinearGeneral(e, (h, e // h), use_bias=False, rngs=rngs))
            self.o = nnx.Linear(e, e, use_bias=False, rngs=rngs)
            self.gate = nnx.Linear(e, s["mlp"], use_bias=False, rngs=rngs)
            self.up = nnx.Linear(e, s["mlp"], use_bias=False, rngs=rngs)
            self.down = nnx.Linear(s["mlp"], e, use_bias=False, rngs=rngs)

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Block(rngs) for _ in range(s["layers"])])

    return Stack


def write_files(folder: Path, s: dict[str, int]) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    e, m = s["embed"], s["mlp"]
    for i in range(s["layers"]):
        shapes = {f"self_attn.{n}_proj.weight": (e, e) for n in "qkvo"}
        shapes.update(
            {"mlp.gate_proj.weight": (m, e), "mlp.up_proj.weight": (m, e), "mlp.down_proj.weight": (e, m)}
        )
        tensors = {
            f"model.layers.{i}.{k}": rng.standard_normal(v, dtype=np.float32) for k, v in shapes.items()
        }
        save_file(tensors, str(folder / f"model-{i + 1:05d}-of-{s['layers']:05d}.safetensors"))


class AnonPeak:
    """The peak of this process's anonymous resident memory (``RssAnon``: not the files' mapped pages, which
    safetensors reads through mmap and the kernel can drop), sampled every 2 ms."""

    def __enter__(self) -> AnonPeak:
        import threading

        self.peak, self._stop = self.now(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def now() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _shape(index, shape) -> tuple[int, ...]:
    return tuple(len(range(*i.indices(d))) for i, d in zip(index, shape, strict=True))


def child(mode: str, folder: str, s: dict[str, int]) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from common import peak_rss_bytes
    from flax import nnx

    import nnx_shard as ns

    files = sorted(Path(folder).glob("*.safetensors"))
    if mode == "read":
        buf = np.empty(max(f.stat().st_size for f in files), np.uint8)
        start = time.perf_counter()
        total = 0
        for f in files:
            with open(f, "rb", buffering=0) as h:
                total += h.readinto(memoryview(buf)[: f.stat().st_size])
        return {"seconds": time.perf_counter() - start, "bytes": total, "peak_rss": peak_rss_bytes()}
    mesh = ns.create_mesh((8,), ("fsdp",))
    strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    live = ns.create_sharded(lambda: model(s)(nnx.Rngs(0)), strategy, mesh)[0]
    # the sharded init is asynchronous: it must be done before the clock starts, or the load is charged for it
    jax.block_until_ready(jax.tree.leaves(nnx.state(live)))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(live)))
    largest = max(s_.data.nbytes for x in jax.tree.leaves(nnx.state(live)) for s_ in x.addressable_shards)
    base_rss, anon = peak_rss_bytes(), AnonPeak()
    anon_before = anon.now()
    anon.__enter__()
    start = time.perf_counter()
    if mode == "place":  # placing the same shards from host memory that is already there: no reading
        blocks = {}
        for _, v in ns.sharding.flatten_state(nnx.state(live)):
            x = v.get_value()
            for index in x.sharding.addressable_devices_indices_map(x.shape).values():
                blocks[(id(v), str(index))] = np.ones(_shape(index, x.shape), x.dtype)
        start = time.perf_counter()
        for _, v in ns.sharding.flatten_state(nnx.state(live)):
            x = v.get_value()
            v.set_value(
                jax.make_array_from_callback(x.shape, x.sharding, lambda i, v=v: blocks[(id(v), str(i))])
            )
        extra = {"bytes": state_bytes, "bytes_needed": state_bytes}
    elif mode == "stream":
        report = ns.load_safetensors(live, folder, rules())
        extra = {"bytes": report.bytes_read, "bytes_needed": report.bytes_needed}
    else:
        import re

        from safetensors.numpy import load_file

        host, read = {}, 0
        for f in files:
            for name, t in load_file(str(f)).items():
                read += t.nbytes
                for regex, target, _ in rules():
                    m = re.fullmatch(regex, name)
                    if m is not None:
                        host[m.expand(target)] = t.T
        flat = dict(ns.sharding.flatten_state(nnx.state(live)))
        values = {p: host[p].reshape(flat[p].get_value().shape) for p in flat}
        placed = ns.place_like_target(values, {p: flat[p].get_value().sharding for p in flat})
        jax.block_until_ready(placed)
        extra = {"bytes": read, "bytes_needed": read}
    jax.block_until_ready(jax.tree.leaves(nnx.state(live)))
    seconds = time.perf_counter() - start
    anon.__exit__()
    return {
        "anon_added": anon.peak - anon_before,
        "seconds": seconds,
        "state_bytes": state_bytes,
        "largest_shard": largest,
        "rss_before_load": base_rss,
        "peak_rss": peak_rss_bytes(),
        **extra,
    }


def run_child(mode: str, folder: str, s: dict[str, int]) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_load as b; "
        "print(json.dumps(b.child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(HERE), mode, folder, json.dumps(s)],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE.parent)},
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = sizes(args.smoke)
    folder = tempfile.mkdtemp()
    write_files(Path(folder), s)
    modes = () if args.smoke else ("read", "stream", "whole")  # a first, cold round (the smoke skips it)
    first = {mode: run_child(mode, folder, s)["seconds"] for mode in modes}
    results = {}
    for mode in ("read", "place", "stream", "whole"):
        r = run_child(mode, folder, s)  # a second round: the files are in the page cache for all
        r["gb_per_s"] = round(r["bytes"] / 1e9 / r["seconds"], 3)
        results[mode] = r
    stream, whole = results["stream"], results["whole"]
    # On a CPU the devices' memory is the host's: what the load adds is the new state (the old one is
    # freed as each leaf is replaced) plus what it holds in flight.
    goal = stream["state_bytes"] + stream["largest_shard"] + 256 * 2**20
    added = {m: results[m]["anon_added"] for m in ("stream", "whole")}
    result = {
        "benchmark": "bench_load",
        "machine": machine(),
        "sizes": s,
        "state_mb": round(stream["state_bytes"] / 2**20, 1),
        "read_gb_per_s": results["read"]["gb_per_s"],
        "stream": stream,
        "whole": whole,
        "place_gb_per_s": results["place"]["gb_per_s"],
        "stream_rate_over_read_rate": round(stream["gb_per_s"] / results["read"]["gb_per_s"], 3),
        # reading then placing, one after the other, at their own rates: what a loader without overlap can
        # reach
        "stream_rate_over_read_then_place": round(
            stream["gb_per_s"] * (1 / results["read"]["gb_per_s"] + 1 / results["place"]["gb_per_s"]), 3
        ),
        "stream_seconds_over_whole": round(stream["seconds"] / whole["seconds"], 3),
        "stream_load_added_anon_rss_mb": round(added["stream"] / 2**20, 1),
        "whole_load_added_anon_rss_mb": round(added["whole"] / 2**20, 1),
        "stream_load_added_peak_rss_mb": round((stream["peak_rss"] - stream["rss_before_load"]) / 2**20, 1),
        "whole_load_added_peak_rss_mb": round((whole["peak_rss"] - whole["rss_before_load"]) / 2**20, 1),
        "rss_goal_mb": round(goal / 2**20, 1),
        "stream_within_rss_goal": added["stream"] <= goal,
        "stream_bytes_read_over_needed": round(stream["bytes"] / stream["bytes_needed"], 3),
        "first_round_seconds": {k: round(v, 3) for k, v in first.items()},
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
