"""ns.suggest against the rule lists users write by hand, checked by the compiler; and how fast it is.

Questions:
1. Does the suggestion's compiled step send as little as the best hand layout that fits the same budget
   (everything replicated, ZeRO-1, full fsdp, fsdp above a size, fsdp with tensor axes)? Each layout's
   train step is compiled with ``Trainer.compile_report``: collective bytes and peak memory per device,
   for the ViT example and a Llama-shaped decoder, on 8 CPU devices and on a TPU topology compiled here.
   The goal: the suggestion's collective bytes at most 1.05x the best fitting hand layout's.
2. How long does ``ns.suggest`` take on Llama-3-70B's shapes over 256 chips (no compile; goal under 10 s),
   and does its cost grow at most linearly with the number of leaves (40 layers against 80)?

    python benchmarks/bench_suggest.py [--smoke] [--out results/bench_suggest.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

from common import machine, simulate_devices, write_json

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def hand_layouts(data: str, tensor: str | None) -> dict[str, list]:
    """The rule lists a user copies from big_vision, MaxText or the ZeRO papers."""
    fsdp = f"fsdp(axis={data!r}, min_size_to_shard_mb=0)"
    out = {
        "everything replicated": [(".*", "replicate()")],
        "ZeRO-1": [("^(optimizer|ema)/", fsdp), (".*", "replicate()")],
        "full fsdp": [(".*", fsdp)],
        "fsdp above 4 MiB (big_vision's default)": [(".*", f"fsdp(axis={data!r})")],
    }
    if tensor:
        out["fsdp with tensor axes"] = [(".*", f"{fsdp}|fsdp(axis={tensor!r}, min_size_to_shard_mb=0)")]
    return out


def sent(report) -> int:
    return sum(v["bytes"] for v in report.collectives.values())


def compare(
    name: str,
    trainer_cls,
    cfg,
    batch,
    devices,
    budget_fraction: float,
    tensor: str | None,
    smoke: bool = False,
) -> dict:
    """Every hand layout and the suggestion compiled for ``devices``; the budget is a fraction of the
    replicated state's bytes (so that replication does not fit and a choice is needed)."""
    from nnx_shard._base import format_bytes

    trainer = trainer_cls(cfg)
    hand = {}
    for label, rules in hand_layouts("fsdp", tensor).items():
        if smoke and label.startswith("fsdp above"):  # the smoke run compiles fewer layouts
            continue
        c = cfg.copy_and_resolve_references()
        c.sharding_strategy = rules
        report = trainer_cls(c).compile_report(devices, batch)
        hand[label] = {
            "state_bytes": report.state_bytes,
            "sent_bytes": sent(report),
            "peak_bytes": report.peak_bytes,
        }
    budget = int(hand["everything replicated"]["state_bytes"] * budget_fraction)
    start = time.perf_counter()
    suggestion = trainer.suggest(batch, budget=budget, devices=devices, tokens_per_step=None)
    seconds = time.perf_counter() - start
    fitting = {k: v for k, v in hand.items() if v["state_bytes"] <= budget}
    best = min(fitting.items(), key=lambda kv: kv[1]["sent_bytes"])
    ours = sum(suggestion.traffic.values())
    print(suggestion)
    return {
        "model": name,
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "budget": format_bytes(budget),
        "budget_bytes": budget,
        "hand_layouts": hand,
        "suggestion": {
            "layout": suggestion.layout,
            "rules": suggestion.rules,
            "sent_bytes": ours,
            "state_bytes": suggestion.state_bytes,
            "seconds_with_compiles": round(seconds, 1),
        },
        "best_fitting_hand_layout": best[0],
        "sent_ratio_to_best_hand": round(ours / max(best[1]["sent_bytes"], 1), 3),
        "goal": "sent_ratio_to_best_hand <= 1.05",
    }


def vit(devices, smoke: bool) -> dict:
    import jax
    import numpy as np

    from examples.vit.config import get_config
    from examples.vit.trainer import ViTTrainer

    cfg = get_config("tiny")
    cfg.progress, cfg.mesh = "off", "fsdp:-1"
    n = 64
    batch = {
        "images": jax.ShapeDtypeStruct((n, 8, 8, 1), np.float32),
        "labels": jax.ShapeDtypeStruct((n,), np.int32),
    }
    return compare("ViT tiny", ViTTrainer, cfg, batch, devices, 0.5, None, smoke)


def llama(devices, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import nnx_shard as ns
    from examples.toy_models import Llama

    class LlamaTrainer(ns.Trainer):
        def create_model(self, rngs: nnx.Rngs) -> nnx.Module:
            return Llama(rngs=rngs, vocab=512, d=128, ff=384, layers=2 if smoke else 4, kv=64)

        def create_optimizer(self):
            return optax.adamw(1e-3)

        def loss_fn(self, model, batch):
            logits = model(batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    cfg = LlamaTrainer.default_config()
    cfg.progress, cfg.mesh, cfg.ema_decay = "off", "fsdp:-1", 0.999
    batch = {"tokens": jax.ShapeDtypeStruct((16, 65), np.int32)}
    del jnp
    return compare("Llama-shaped decoder", LlamaTrainer, cfg, batch, devices, 0.5, None)


def speed(smoke: bool) -> dict:
    """ns.suggest on Llama-3-70B's shapes (model, adamw, EMA) over v5e:16x16, and at half the depth."""
    import optax
    from flax import nnx

    import nnx_shard as ns
    from examples.toy_models import llama as build_llama
    from nnx_shard._base import abstract_construction

    out = {}
    devices = ns.cluster.tpu_devices("v5e:2x4" if smoke else "v5e:16x16")
    mesh = ns.create_mesh((len(devices),), ("fsdp",), devices=devices)
    for layers in (4, 8) if smoke else (40, 80):

        def build(layers=layers):
            model = build_llama(rngs=nnx.Rngs(0), size="tiny" if smoke else "70b", layers=layers)
            opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
            return {"model": model, "optimizer": opt, "ema": nnx.EMA(model, decay=0.999, only=nnx.Param)}

        with abstract_construction():
            state = nnx.eval_shape(build)
        start = time.perf_counter()
        suggestion = ns.suggest(state, mesh)
        seconds = time.perf_counter() - start
        out[f"{layers} layers"] = {
            "leaves": len(suggestion.plan.leaves),
            "suggest_seconds": round(seconds, 2),
            "layout": suggestion.layout,
            "state_per_chip": suggestion.state_bytes,
            "budget": suggestion.budget,
        }
    a, b = out.values()
    out["seconds_per_leaf_ratio_deep_vs_half"] = round(
        (b["suggest_seconds"] / b["leaves"]) / (a["suggest_seconds"] / a["leaves"]), 2
    )
    out["goal"] = "70B (80 layers) under 10 s; seconds per leaf ratio <= ~1.2 (linear)"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    simulate_devices(8)
    import jax

    import nnx_shard as ns

    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "compiled": []}
    cpu = jax.devices()
    result["compiled"].append(vit(cpu, args.smoke))
    if not args.smoke:
        result["compiled"].append(llama(cpu, args.smoke))
    if HAS_LIBTPU:
        if not args.smoke:  # XLA's TPU compiler takes ~8 s a layout here: not in the smoke run
            tpu = ns.cluster.tpu_devices("v5e:2x4")
            result["compiled"] += [vit(tpu, args.smoke), llama(tpu, args.smoke)]
        result["speed"] = speed(args.smoke)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
