"""Configs for the ViT example: ``get_config("tiny")``, ``"tiny_tp"``, ``"b16"``, ..., ``"b16,synthetic"``."""

from __future__ import annotations

import ml_collections

# Sizes from the ViT paper (Dosovitskiy et al., 2021, table 1), plus "tiny" for 8x8 digits.
SIZES = {
    "tiny": dict(patch=2, width=64, depth=4, heads=4, mlp=128),
    "ti16": dict(patch=16, width=192, depth=12, heads=3, mlp=768),
    "s16": dict(patch=16, width=384, depth=12, heads=6, mlp=1536),
    "b16": dict(patch=16, width=768, depth=12, heads=12, mlp=3072),
    "l16": dict(patch=16, width=1024, depth=24, heads=16, mlp=4096),
    "h14": dict(patch=14, width=1280, depth=32, heads=16, mlp=5120),
}

FSDP = [
    (r".*(cls|pos_emb)$", "replicate"),
    (r".*", "fsdp(axis='fsdp')"),
]

# Tensor parallel (Megatron style) for attention and MLP, fsdp for the rest.
TENSOR_PARALLEL = [
    (r"^blocks/\d+/attn/(query|key|value)/kernel$", "shard_dim(axis='tp', dim=-1)|fsdp(axis='fsdp')"),
    (r"^blocks/\d+/attn/(query|key|value)/bias$", "shard_dim(axis='tp', dim=-1)"),
    (r"^blocks/\d+/attn/out/kernel$", "shard_dim(axis='tp', dim=0)|fsdp(axis='fsdp')"),
    (r"^blocks/\d+/mlp/up/kernel$", "shard_dim(axis='tp', dim=-1)|fsdp(axis='fsdp')"),
    (r"^blocks/\d+/mlp/up/bias$", "shard_dim(axis='tp', dim=-1)"),
    (r"^blocks/\d+/mlp/down/kernel$", "shard_dim(axis='tp', dim=0)|fsdp(axis='fsdp')"),
    *FSDP,
]


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    """``arg`` is a size (tiny, ti16, s16, b16, l16, h14), ``_tp`` for tensor parallel, ``,synthetic`` for
    fake data, ``,bf16`` / ``,f32`` for the compute dtype (parameters stay float32; the ViT-B and larger
    sizes compute in bfloat16 by default).

    >>> cfg = get_config("b16_tp,synthetic")
    >>> cfg.model.width, cfg.mesh, cfg.data.name, cfg.data.image_size, cfg.model.dtype
    (768, 'fsdp:-1,tp:2', 'synthetic', 224, 'bfloat16')
    """
    parts = [p.strip() for p in arg.split(",") if p.strip()]
    size = parts[0] if parts else "tiny"
    tp = size.endswith("_tp")
    size = size.removesuffix("_tp")
    if size not in SIZES:
        raise ValueError(
            f"unknown ViT size {size!r}; use one of {sorted(SIZES)} (with _tp for tensor parallel)."
        )
    synthetic = "synthetic" in parts[1:] or size != "tiny"
    cfg = ml_collections.ConfigDict()
    cfg.data = ml_collections.ConfigDict(
        dict(
            name="synthetic" if synthetic else "digits",
            image_size=8 if size == "tiny" else 224,
            channels=1 if size == "tiny" else 3,
            num_classes=10 if size == "tiny" else 1000,
            batch_size=128,
            seed=0,
            augment=not synthetic,
        )
    )
    bf16 = "bf16" in parts[1:] or (size not in ("tiny", "ti16", "s16") and "f32" not in parts[1:])
    cfg.model = ml_collections.ConfigDict(
        dict(
            SIZES[size],
            image_size=cfg.data.image_size,
            channels=cfg.data.channels,
            num_classes=cfg.data.num_classes,
            dtype="bfloat16" if bf16 else "float32",  # compute; parameters are float32 either way
        )
    )
    cfg.mesh = "fsdp:-1,tp:2" if tp else "fsdp:-1"
    strategy = TENSOR_PARALLEL if tp else FSDP
    if size == "tiny":  # every tiny leaf is far below fsdp's 4 MiB default: shard them anyway, to show it
        strategy = [
            (p, t.replace("fsdp(axis='fsdp')", "fsdp(axis='fsdp', min_size_to_shard_mb=0)"))
            for p, t in strategy
        ]
    cfg.sharding_strategy = strategy
    cfg.weight_decay = 1e-4
    cfg.accumulate = 1  # > 1: accumulate gradients over this many steps (optax.MultiSteps)
    cfg.learning_rate = 3e-3
    cfg.warmup_steps = 20
    cfg.total_steps = 600
    cfg.ema_decay = 0.99
    cfg.log_every = 10
    cfg.eval_every = 0
    cfg.save_every = 100
    cfg.seed = 0
    cfg.workdir = ""
    cfg.progress = "auto"
    return cfg
