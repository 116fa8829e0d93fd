"""A Hugging Face ``config.json`` read into google-tunix's ModelConfig fields: each field that changes the
forward pass carried, or refused by name.

Each family's reader returns the fields of tunix's ``ModelConfig`` (plus
``rope_kind`` / ``rope_parameters`` for the classes of :mod:`._models`), and
raises :class:`~nnx_shard.errors.UnsupportedConfigError` for a value the class
cannot compute, before any weight is read. :data:`TABLE` says, per family, what
is carried and what is refused; the fine-tuning page prints it.
"""

from __future__ import annotations

from typing import Any

from nnx_shard._families._rope import Rope, rope_of
from nnx_shard.errors import UnsupportedConfigError

# transformers' class defaults, for a config.json that states no theta
_THETA = {"llama": 10_000.0, "mistral": 10_000.0, "qwen2": 10_000.0, "qwen3": 10_000.0, "gemma": 10_000.0}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")

#: Per family: the config fields carried into the model, and those refused (with the values that load).
TABLE: dict[str, tuple[str, str]] = {
    "Llama 3 (LlamaForCausalLM), Mistral (MistralForCausalLM)": (
        "sizes, `rms_norm_eps`, `tie_word_embeddings`, `rope_theta` and `rope_scaling` / `rope_parameters` "
        "of type `default`, `linear` or `llama3` (nnx_shard's Llama3, built on tunix's)",
        "`rope_type` `yarn`, `dynamic`, `longrope`...; `hidden_act` other than `silu`; `attention_bias`, "
        "`mlp_bias`; `partial_rotary_factor` < 1; Mistral's `sliding_window`",
    ),
    "Qwen 2 / 2.5 (Qwen2ForCausalLM)": (
        "sizes, `rms_norm_eps`, `tie_word_embeddings`, `rope_theta` (tunix's Qwen2)",
        "any `rope_scaling` / `rope_type` but `default`; `use_sliding_window` or a sliding `layer_types`; "
        "`hidden_act` other than `silu`",
    ),
    "Qwen 3 (Qwen3ForCausalLM)": (
        "sizes, `rms_norm_eps`, `tie_word_embeddings`, `rope_theta`, `rope_type` `default`, `linear`, "
        "`llama3` (nnx_shard's Qwen3, built on tunix's)",
        "other `rope_type`s; `use_sliding_window`; `attention_bias`; `hidden_act` other than `silu`",
    ),
    "Gemma (GemmaForCausalLM), Gemma 2 (Gemma2ForCausalLM)": (
        "sizes; Gemma 2's `attn_logit_softcapping`, `final_logit_softcapping`, `sliding_window`, "
        "`layer_types`",
        "`rope_theta` other than 10,000 and any rope scaling (tunix's Gemma fixes both); "
        "`query_pre_attn_scalar` other than `head_dim`; `rms_norm_eps` other than 1e-6; untied embeddings; "
        "an activation other than tanh GELU; `attention_bias`",
    ),
    "Gemma 3 (Gemma3ForCausalLM)": (
        "sizes, `rope_theta` / `rope_local_base_freq` or `rope_parameters` per layer type, `linear` scaling "
        "of either, `sliding_window`, `query_pre_attn_scalar` of `head_dim` or `hidden_size / heads`",
        "softcaps; other rope types; `layer_types` other than tunix's 5 sliding : 1 global cycle; "
        "`rms_norm_eps` other than 1e-6; untied embeddings; an activation other than tanh GELU; "
        "`attention_bias`; `use_bidirectional_attention`",
    ),
}


def refuse(arch: str, field: str, value: Any, need: str) -> UnsupportedConfigError:
    """The error for one field of ``arch``'s config that the model class cannot compute."""
    return UnsupportedConfigError(
        f"{arch}: config.json's {field}={value!r} changes the forward pass, and {need}. Nothing was read; "
        f"loading anyway would give logits unlike transformers'.",
        field=field,
        value=value,
    )


def _require(
    hf: dict[str, Any], arch: str, field: str, allowed: tuple[Any, ...], need: str, default: Any = None
):
    value = hf.get(field, default)
    if value not in allowed:
        raise refuse(arch, field, value, need)


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def shape(hf: dict[str, Any], vocab: str) -> dict[str, Any]:
    """The sizes every tunix ModelConfig takes (``vocab``: tunix's name for the vocabulary size)."""
    return {
        "num_layers": hf["num_hidden_layers"],
        vocab: hf["vocab_size"],
        "embed_dim": hf["hidden_size"],
        "hidden_dim": hf["intermediate_size"],
        "num_heads": hf["num_attention_heads"],
        "head_dim": head_dim(hf),
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
    }


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _checked_rope(hf: dict[str, Any], arch: str, layer: str, kinds: tuple[str, ...], default: float) -> Rope:
    rope = rope_of(hf, layer, default_theta=default)
    field = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    if rope.kind not in kinds:
        raise refuse(
            arch, f"{field}.rope_type", rope.kind, f"the model applies rope of type {' or '.join(kinds)} only"
        )
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
    missing = [k for k in needed.get(rope.kind, ()) if rope.parameter(k) is None]
    if missing:
        raise refuse(arch, field, dict(rope.parameters), f"rope {rope.kind} needs {missing}")
    return rope


def _full_attention_only(hf: dict[str, Any], arch: str) -> None:
    _require(hf, arch, "use_sliding_window", (None, False), "the model attends to every earlier token")
    kinds = set(hf.get("layer_types") or ())
    if kinds - {"full_attention"}:
        raise refuse(arch, "layer_types", hf["layer_types"], "the model has full attention in every layer")


def decoder(
    hf: dict[str, Any], arch: str, *, family: str, tied: str, rope_kinds: tuple[str, ...]
) -> dict[str, Any]:
    """Llama 3, Mistral, Qwen 2 and Qwen 3 into tunix's (or nnx_shard's) ModelConfig fields."""
    _require(hf, arch, "hidden_act", ("silu",), "the model's MLP uses SiLU", default="silu")
    _require(hf, arch, "mlp_bias", (None, False), "the model's MLP has no biases")
    if family != "qwen2":  # Qwen 2's q/k/v biases are part of the model; the others have none
        _require(hf, arch, "attention_bias", (None, False), "the model's attention has no biases")
    _require(hf, arch, "partial_rotary_factor", (None, 1, 1.0), "the model rotates whole heads")
    if family == "mistral":
        _require(hf, arch, "sliding_window", (None,), "the model (Llama 3's) has no sliding window")
    if family in ("qwen2", "qwen3"):
        _full_attention_only(hf, arch)
    rope = _checked_rope(hf, arch, "full_attention", rope_kinds, _THETA[family])
    fields = dict(
        **shape(hf, "vocab_size"),
        rope_theta=_number(rope.theta),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        **{tied: bool(hf.get("tie_word_embeddings", False))},
    )
    if rope_kinds != ("default",):  # nnx_shard's classes: the scaling travels in the config
        fields.update(rope_kind=rope.kind, rope_parameters=rope.parameters)
    return fields


def _gemma_common(hf: dict[str, Any], arch: str, activation: str) -> None:
    _require(hf, arch, activation, _TANH_GELU, "the model's MLP uses tanh GELU", default="gelu_pytorch_tanh")
    _require(hf, arch, "rms_norm_eps", (1e-6,), "tunix's Gemma RMSNorm uses 1e-6", default=1e-6)
    _require(
        hf, arch, "tie_word_embeddings", (True,), "tunix's Gemma decodes with the embedding", default=True
    )
    _require(hf, arch, "attention_bias", (None, False), "the model's attention has no biases")


def gemma(module: Any, hf: dict[str, Any], arch: str, second: bool) -> dict[str, Any]:
    """Gemma and Gemma 2 into tunix's ``gemma`` ModelConfig fields."""
    _gemma_common(hf, arch, "hidden_activation" if second else "hidden_act")
    for layer in ("full_attention", "sliding_attention") if second else ("full_attention",):
        rope = _checked_rope(hf, arch, layer, ("default",), _THETA["gemma"])
        if rope.theta != 10_000:
            raise refuse(arch, "rope_theta", rope.theta, "tunix's Gemma applies rope with theta 10,000")
    if second:
        _require(
            hf,
            arch,
            "query_pre_attn_scalar",
            (head_dim(hf),),
            f"tunix's Gemma scales queries by head_dim={head_dim(hf)}**-0.5",
            default=head_dim(hf),
        )
    kinds = hf.get("layer_types") or [
        "sliding_attention" if second and i % 2 == 0 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    if not second and set(kinds) != {"full_attention"}:
        raise refuse(arch, "layer_types", kinds, "Gemma 1 has full attention in every layer")
    kind = module.AttentionType
    return dict(
        **shape(hf, "num_embed"),
        final_logit_softcap=hf.get("final_logit_softcapping") if second else None,
        attn_logits_soft_cap=hf.get("attn_logit_softcapping") if second else None,
        use_post_attn_norm=second,
        use_post_ffw_norm=second,
        attention_types=tuple(kind.LOCAL_SLIDING if t == "sliding_attention" else kind.GLOBAL for t in kinds),
        sliding_window_size=hf.get("sliding_window") if second else None,
    )


def _gemma3_layer_types(hf: dict[str, Any]) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(hf["num_hidden_layers"])
    ]


def gemma3(module: Any, hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 3 (text) into tunix's ``gemma3`` ModelConfig fields."""
    import jax.numpy as jnp

    _gemma_common(hf, arch, "hidden_activation")
    _require(hf, arch, "use_bidirectional_attention", (None, False), "the model is causal")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        _require(hf, arch, cap, (None,), "tunix's Gemma3 has no softcap")
    tunix = [
        "sliding_attention" if t == module.AttentionType.LOCAL_SLIDING else "full_attention"
        for t in module.GEMMA3_ATTENTION_PATTERN
    ]
    want = [tunix[i % len(tunix)] for i in range(hf["num_hidden_layers"])]
    if _gemma3_layer_types(hf) != want:
        raise refuse(arch, "layer_types", _gemma3_layer_types(hf), f"tunix's Gemma3 cycles {tunix}")
    local = _checked_rope(hf, arch, "sliding_attention", ("default", "linear"), 10_000.0)
    full = _checked_rope(hf, arch, "full_attention", ("default", "linear"), 1_000_000.0)
    fields = shape(hf, "num_embed")
    norm = module.QueryPreAttentionNormalisation
    scalars = {fields["head_dim"]: norm.BY_ONE_OVER_SQRT_HEAD_DIM}
    scalars.setdefault(
        hf["hidden_size"] // hf["num_attention_heads"], norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    )
    scalar = hf.get("query_pre_attn_scalar", fields["head_dim"])
    if scalar not in scalars:
        raise refuse(
            arch,
            "query_pre_attn_scalar",
            scalar,
            f"tunix's Gemma3 scales queries by one of {sorted(scalars)}**-0.5",
        )
    return dict(
        **fields,
        sliding_window_size=hf.get("sliding_window"),
        local_base_frequency=_number(local.theta),
        global_base_frequency=_number(full.theta),
        local_scale_factor=float(local.parameter("factor", 1.0)),
        global_scale_factor=float(full.parameter("factor", 1.0)),
        query_pre_attn_norm=scalars[scalar],
        param_dtype=jnp.float32,  # tunix's default is bfloat16; the weights bring their own dtype
    )
