"""Key maps for the model families users load from Hugging Face into google-tunix's classes.

A key map is the ordered ``(regex over file tensor names, target, transform)``
list that :func:`nnx_shard.load_safetensors` reads and
:func:`nnx_shard.save_safetensors` inverts. The maps here take a Hugging Face
folder (``config.json``'s ``architectures``) to tunix's ``Llama3``, ``Qwen2``,
``Qwen3``, ``Gemma`` (Gemma 1 and 2) and ``Gemma3``: PyTorch's ``(out, in)`` weights transposed, attention
projections reshaped to tunix's ``(embed, heads, head_dim)`` einsum kernels by
the implied reshape (Hugging Face's q/k rows are already in the rotate-half
order tunix's RoPE uses: no permutation). Gemma's q/k/v go into tunix's fused
``qkv_einsum`` (or ``q_einsum`` and ``kv_einsum``) as stacked slices, reshaped by
the head counts of its ``config.json``. Any other model takes an explicit
key map, as before.

>>> import nnx_shard as ns
>>> ns.key_maps.for_architecture("LlamaForCausalLM") is ns.key_maps.LLAMA3
True
>>> sorted(ns.key_maps.ARCHITECTURES)
['Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'GemmaForCausalLM', 'LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM']
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nnx_shard.errors import WeightsMismatchError

Rule = tuple[str, Any] | tuple[str, Any, str | None]

_DECODER: list[Rule] = [
    (r"model\.embed_tokens\.weight", "embedder/input_embedding"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", r"layers/\1/attn/\2_proj/w", "T"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers/\1/mlp/\2_proj/kernel", "T"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers/\1/\2/w"),
    (r"model\.norm\.weight", "final_norm/w"),
    (r"lm_head\.weight", "lm_head/w", "T"),
]

#: Hugging Face ``LlamaForCausalLM`` -> ``tunix.models.llama3.model.Llama3``.
LLAMA3: list[Rule] = _DECODER
#: Hugging Face ``Qwen2ForCausalLM`` -> ``tunix.models.qwen2.model.Qwen2`` (q/k/v biases).
QWEN2: list[Rule] = [
    *_DECODER,
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.bias", r"layers/\1/attn/\2_bias"),
]
#: Hugging Face ``Qwen3ForCausalLM`` -> ``tunix.models.qwen3.model.Qwen3`` (q/k norms).
QWEN3: list[Rule] = [
    *_DECODER,
    (r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", r"layers/\1/attn/\2_norm/w"),
]

_GEMMA_COMMON: list[Rule] = [
    (r"model\.embed_tokens\.weight", "embedder/input_embedding"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers/\1/attn/attn_vec_einsum/w", "T"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers/\1/mlp/\2_proj/kernel", "T"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers/\1/pre_attention_norm/scale"),
    (r"model\.norm\.weight", "final_norm/scale"),
]


def _gemma_attention(hf: dict[str, Any]) -> list[Rule]:
    """q/k/v of ``(heads * head_dim, embed)`` into tunix's ``(heads, embed, head_dim)`` einsums: one fused
    ``qkv_einsum`` when there are as many kv heads as query heads, else ``q_einsum`` and a stacked ``kv_einsum``."""
    n, k = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    h, d = hf.get("head_dim") or hf["hidden_size"] // n, hf["hidden_size"]
    heads = lambda count: f"reshape({count}, {h}, {d}) | transpose(0, 2, 1)"
    proj = lambda x: rf"model\.layers\.(\d+)\.self_attn\.{x}_proj\.weight"
    if n == k:
        return [(proj(x), rf"layers/\1/attn/qkv_einsum/w[{i}]", heads(n)) for i, x in enumerate("qkv")]
    return [
        (proj("q"), r"layers/\1/attn/q_einsum/w", heads(n)),
        (proj("k"), r"layers/\1/attn/kv_einsum/w[0]", heads(k)),
        (proj("v"), r"layers/\1/attn/kv_einsum/w[1]", heads(k)),
    ]


def gemma(hf: dict[str, Any]) -> list[Rule]:
    """Hugging Face ``GemmaForCausalLM`` -> ``tunix.models.gemma.model.Gemma`` (its ``config.json`` as a dict:
    the attention's reshapes need the head counts). The tied ``lm_head`` is the embedding."""
    return [
        *_GEMMA_COMMON,
        *_gemma_attention(hf),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers/\1/pre_ffw_norm/scale"),
    ]


def gemma2(hf: dict[str, Any]) -> list[Rule]:
    """Hugging Face ``Gemma2ForCausalLM`` -> ``tunix.models.gemma.model.Gemma`` with post-attention and post-FFW
    norms (its ``config.json`` as a dict)."""
    norms = {"post_attention": "post_attn", "pre_feedforward": "pre_ffw", "post_feedforward": "post_ffw"}
    return [
        *_GEMMA_COMMON,
        *_gemma_attention(hf),
        *(
            (rf"model\.layers\.(\d+)\.{a}_layernorm\.weight", rf"layers/\1/{b}_norm/scale")
            for a, b in norms.items()
        ),
    ]


def gemma3(hf: dict[str, Any]) -> list[Rule]:
    """Hugging Face ``Gemma3ForCausalLM`` (text) -> ``tunix.models.gemma3.model.Gemma3``: Gemma 2's layout with
    q/k norms, under ``language_model.`` too (the weights of a multimodal checkpoint's text tower)."""
    norms = {"post_attention": "post_attention", "pre_feedforward": "pre_ffw", "post_feedforward": "post_ffw"}
    rules = [
        *_GEMMA_COMMON,
        *_gemma_attention(hf),
        *(
            (rf"model\.layers\.(\d+)\.{a}_layernorm\.weight", rf"layers/\1/{b}_norm/scale")
            for a, b in norms.items()
        ),
        (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"layers/\1/attn/_query_norm/scale"),
        (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"layers/\1/attn/_key_norm/scale"),
    ]
    return [(f"(?:language_model\\.)?{pattern}", *rest) for pattern, *rest in rules]


def _shape(hf: dict[str, Any], vocab: str) -> dict[str, Any]:
    """The sizes every tunix ModelConfig takes, from ``config.json`` (``vocab``: tunix's name for the vocabulary)."""
    return {
        "num_layers": hf["num_hidden_layers"],
        vocab: hf["vocab_size"],
        "embed_dim": hf["hidden_size"],
        "hidden_dim": hf["intermediate_size"],
        "num_heads": hf["num_attention_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
    }


def _gemma3_config(module: Any, hf: dict[str, Any]) -> dict[str, Any]:
    import jax.numpy as jnp

    fields = _shape(hf, "num_embed")
    norm = module.QueryPreAttentionNormalisation
    scalar = hf.get("query_pre_attn_scalar", fields["head_dim"])
    by = norm.BY_ONE_OVER_SQRT_HEAD_DIM if scalar == fields["head_dim"] else None
    return dict(
        **fields,
        sliding_window_size=hf.get("sliding_window"),
        local_base_frequency=int(hf.get("rope_local_base_freq", 10_000)),
        global_base_frequency=int(hf.get("rope_theta", 10_000)),
        global_scale_factor=float((hf.get("rope_scaling") or {}).get("factor", 1.0)),
        **({"query_pre_attn_norm": by} if by is not None else {}),
        param_dtype=jnp.float32,  # tunix's default is bfloat16; the weights bring their own dtype
    )


def _decoder_config(hf: dict[str, Any], tied_field: str | None) -> dict[str, Any]:
    fields = dict(
        **_shape(hf, "vocab_size"),
        rope_theta=int(hf.get("rope_theta", 10_000)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )
    if tied_field is not None:
        fields[tied_field] = bool(hf.get("tie_word_embeddings", False))
    return fields


def _gemma_config(module: Any, hf: dict[str, Any], second: bool) -> dict[str, Any]:
    kinds = hf.get("layer_types") or [
        "sliding_attention" if second and i % 2 == 0 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    kind = module.AttentionType
    return dict(
        **_shape(hf, "num_embed"),
        final_logit_softcap=hf.get("final_logit_softcapping") if second else None,
        attn_logits_soft_cap=hf.get("attn_logit_softcapping") if second else None,
        use_post_attn_norm=second,
        use_post_ffw_norm=second,
        attention_types=tuple(kind.LOCAL_SLIDING if t == "sliding_attention" else kind.GLOBAL for t in kinds),
        sliding_window_size=hf.get("sliding_window") if second else None,
    )


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face architecture as google-tunix has it: the key map (a list, or built from ``config.json``
    when its reshapes need the head counts), tunix's module and class, and its ModelConfig's fields."""

    key_map: list[Rule] | Callable[[dict[str, Any]], list[Rule]]
    module: str
    cls: str
    config: Callable[[Any, dict[str, Any]], dict[str, Any]]

    def rules(self, hf: dict[str, Any] | None) -> list[Rule]:
        if callable(self.key_map):
            if hf is None:
                raise WeightsMismatchError(
                    f"the key map for {self.cls} is built from the model's config.json (head counts): pass "
                    f"the Hugging Face folder, or key_map=ns.key_maps.{self.key_map.__name__}(config_dict)."
                )
            return self.key_map(hf)
        return self.key_map


#: ``config.json`` ``architectures`` -> the google-tunix family that loads it.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LLAMA3, "tunix.models.llama3.model", "Llama3", lambda m, hf: _decoder_config(hf, "weight_tying")),
    "Qwen2ForCausalLM": Family(QWEN2, "tunix.models.qwen2.model", "Qwen2", lambda m, hf: _decoder_config(hf, "use_tied_embedding")),
    "Qwen3ForCausalLM": Family(QWEN3, "tunix.models.qwen3.model", "Qwen3", lambda m, hf: _decoder_config(hf, "use_tied_embedding")),
    "GemmaForCausalLM": Family(gemma, "tunix.models.gemma.model", "Gemma", lambda m, hf: _gemma_config(m, hf, False)),
    "Gemma2ForCausalLM": Family(gemma2, "tunix.models.gemma.model", "Gemma", lambda m, hf: _gemma_config(m, hf, True)),
    "Gemma3ForCausalLM": Family(gemma3, "tunix.models.gemma3.model", "Gemma3", _gemma3_config),
}  # fmt: skip


def for_architecture(name: str, config: dict[str, Any] | None = None) -> list[Rule]:
    """The key map of a Hugging Face architecture name (``config.json``'s ``architectures[0]``); Gemma's is
    built from the ``config.json`` dict."""
    if name not in ARCHITECTURES:
        raise WeightsMismatchError(
            f"no key map is shipped for the architecture {name!r} (shipped: {sorted(ARCHITECTURES)}); pass "
            f"key_map=[(regex over file tensor names, model path, transform), ...]."
        )
    return ARCHITECTURES[name].rules(config)


def hf_config(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``folder``'s ``config.json`` as a dict (None without one)."""
    config = Path(folder) / "config.json"
    if not Path(folder).is_dir() or not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (json.JSONDecodeError, OSError) as e:
        raise WeightsMismatchError(f"{config} is not readable JSON: {e}") from e


def architecture_of(folder: str | os.PathLike[str]) -> str | None:
    """``config.json``'s first ``architectures`` entry in ``folder`` (None without one)."""
    names = (hf_config(folder) or {}).get("architectures") or []
    return names[0] if names else None


def _for_model(model: Any) -> tuple[list[Rule], str] | None:
    for cls in type(model).__mro__:
        for arch, family in ARCHITECTURES.items():
            if (
                cls.__name__ == family.cls
                and cls.__module__ == family.module
                and not callable(family.key_map)
            ):
                return family.key_map, f"{arch} (from the model's class {family.module}.{family.cls})"
    return None


def resolve_key_map(
    key_map: Sequence[Rule] | None, model: Any, folder: str | os.PathLike[str] | Sequence[Any] | None
) -> tuple[Sequence[Rule], str | None]:
    """``key_map`` as given, else the map for ``folder``'s architecture or the model's class, and its name."""
    if key_map is not None:
        return key_map, None
    if folder is not None and not isinstance(folder, (list, tuple)):
        arch = architecture_of(folder)
        if arch is not None:
            return for_architecture(arch, hf_config(folder)), f"key map {arch} (from config.json)"
    found = _for_model(model)
    if found is not None:
        return found[0], f"key map {found[1]}"
    raise WeightsMismatchError(
        f"no key_map given, and none is known for {type(model).__name__} or the folder {folder!r} (no "
        f"config.json with an architecture among {sorted(ARCHITECTURES)}): pass key_map=[(regex, target, "
        f"transform), ...]."
    )


def tunix_model(folder: str | os.PathLike[str], **overrides: Any) -> tuple[type, Any]:
    """tunix's class and ``ModelConfig`` for a Hugging Face folder, read from its ``config.json``.

    ``overrides`` replace config fields (``shd_config=...``, ``remat_config=...``).
    Needs google-tunix (``pip install nnx-shard[hf]``).
    """
    import importlib

    arch = architecture_of(folder)
    if arch not in ARCHITECTURES:
        raise WeightsMismatchError(f"{folder} has no config.json architecture among {sorted(ARCHITECTURES)}.")
    family = ARCHITECTURES[arch]
    module = importlib.import_module(family.module)
    hf = hf_config(folder) or {}
    scalar = hf.get("query_pre_attn_scalar")
    if scalar is not None and scalar != (
        hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    ):
        warnings.warn(
            f"{folder}: query_pre_attn_scalar={scalar} is not head_dim; tunix's Gemma scales queries by "
            f"head_dim**-0.5, so its logits will differ from transformers'.",
            stacklevel=2,
        )
    fields = family.config(module, hf)
    names = set(getattr(module.ModelConfig, "__dataclass_fields__", {}))
    fields = {k: v for k, v in fields.items() if k in names}
    fields.update(overrides)
    return getattr(module, family.cls), module.ModelConfig(**fields)
