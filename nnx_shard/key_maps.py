"""Key maps for the model families users load from Hugging Face into google-tunix's classes.

A key map is the ordered ``(regex over file tensor names, target, transform)``
list that :func:`nnx_shard.load_safetensors` reads and
:func:`nnx_shard.save_safetensors` inverts. The maps here take a Hugging Face
folder (``config.json``'s ``architectures``) to tunix's ``Llama3`` (Llama and Mistral), ``Qwen2``,
``Qwen3``, ``Gemma`` (Gemma 1 and 2) and ``Gemma3``: PyTorch's ``(out, in)`` weights transposed, attention
projections reshaped to tunix's ``(embed, heads, head_dim)`` einsum kernels by
the implied reshape (Hugging Face's q/k rows are already in the rotate-half
order tunix's RoPE uses: no permutation). Gemma's q/k/v go into tunix's fused
``qkv_einsum`` (or ``q_einsum`` and ``kv_einsum``) as stacked slices, reshaped by
the head counts of its ``config.json``. Any other model takes an explicit
key map, as before. :func:`tunix_model` builds the class and config from
``config.json``, carrying every field that changes the forward pass or refusing
it by name (:class:`~nnx_shard.errors.UnsupportedConfigError`).

>>> import nnx_shard as ns
>>> ns.key_maps.for_architecture("LlamaForCausalLM") is ns.key_maps.LLAMA3
True
>>> sorted(ns.key_maps.ARCHITECTURES)
['Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'GemmaForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM',
'Qwen2ForCausalLM', 'Qwen3ForCausalLM']
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nnx_shard._families import ROPE_MODELS, decoder, head_dim, rope_model
from nnx_shard._families import gemma as _gemma
from nnx_shard._families import gemma3 as _gemma3
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
    ``qkv_einsum`` when there are as many kv heads as query heads, else ``q_einsum`` and a stacked
    ``kv_einsum``."""
    n, k = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    h, d = head_dim(hf), hf["hidden_size"]
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
    """Hugging Face ``Gemma2ForCausalLM`` -> ``tunix.models.gemma.model.Gemma`` with post-attention and
    post-FFW norms (its ``config.json`` as a dict)."""
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
    """Hugging Face ``Gemma3ForCausalLM`` (text) -> ``tunix.models.gemma3.model.Gemma3``: Gemma 2's layout
    with q/k norms, under ``language_model.`` too (the weights of a multimodal checkpoint's text tower)."""
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


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face architecture as google-tunix has it: the key map (a list, or built from ``config.json``
    when its reshapes need the head counts), tunix's module and class, and its ModelConfig's fields."""

    key_map: list[Rule] | Callable[[dict[str, Any]], list[Rule]]
    module: str
    cls: str
    config: Callable[[Any, dict[str, Any], str], dict[str, Any]]

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
_ROPE = ("default", "linear", "llama3")  # what nnx_shard's Llama3 and Qwen3 apply
_LLAMA = "tunix.models.llama3.model"


def _llama(family: str) -> Callable[[Any, dict[str, Any], str], dict[str, Any]]:
    return lambda m, hf, arch: decoder(hf, arch, family=family, tied="weight_tying", rope_kinds=_ROPE)


#: ``config.json`` ``architectures`` -> the google-tunix family that loads it.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LLAMA3, _LLAMA, "Llama3", _llama("llama")),
    # Mistral without a sliding window is Llama's layout and computation (a window is refused by name)
    "MistralForCausalLM": Family(LLAMA3, _LLAMA, "Llama3", _llama("mistral")),
    "Qwen2ForCausalLM": Family(
        QWEN2,
        "tunix.models.qwen2.model",
        "Qwen2",
        lambda m, hf, arch: decoder(
            hf, arch, family="qwen2", tied="use_tied_embedding", rope_kinds=("default",)
        ),
    ),
    "Qwen3ForCausalLM": Family(
        QWEN3,
        "tunix.models.qwen3.model",
        "Qwen3",
        lambda m, hf, arch: decoder(hf, arch, family="qwen3", tied="use_tied_embedding", rope_kinds=_ROPE),
    ),
    "GemmaForCausalLM": Family(
        gemma, "tunix.models.gemma.model", "Gemma", lambda m, hf, a: _gemma(m, hf, a, False)
    ),
    "Gemma2ForCausalLM": Family(
        gemma2, "tunix.models.gemma.model", "Gemma", lambda m, hf, a: _gemma(m, hf, a, True)
    ),
    "Gemma3ForCausalLM": Family(gemma3, "tunix.models.gemma3.model", "Gemma3", _gemma3),
}
#: Architectures with no map of their own, and what to do instead.
ALIASES = {
    "Gemma3ForConditionalGeneration": "its text tower loads as Gemma3ForCausalLM: pass its text_config as "
    "config.json and key_map=ns.key_maps.gemma3(text_config)",
    "Qwen2MoeForCausalLM": "tunix has no Qwen 2 MoE class here",
    "Qwen3MoeForCausalLM": "tunix's Qwen3 has experts (num_experts) but no key map is shipped for them",
}


def _unknown(name: str) -> str:
    hint = f": {ALIASES[name]}" if name in ALIASES else ""
    return (
        f"no key map is shipped for the architecture {name!r}{hint} (shipped: {sorted(ARCHITECTURES)}); pass "
        f"key_map=[(regex over file tensor names, model path, transform), ...]."
    )


def for_architecture(name: str, config: dict[str, Any] | None = None) -> list[Rule]:
    """The key map of a Hugging Face architecture name (``config.json``'s ``architectures[0]``); Gemma's is
    built from the ``config.json`` dict.

    >>> for_architecture("MistralForCausalLM") is LLAMA3
    True
    """
    if name not in ARCHITECTURES:
        raise WeightsMismatchError(_unknown(name))
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
    return _architecture(hf_config(folder))


def _architecture(hf: dict[str, Any] | None) -> str | None:
    names = (hf or {}).get("architectures") or []
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
    if (
        isinstance(folder, (str, os.PathLike))
        and not any(c in str(folder) for c in "*?[")
        and not Path(folder).exists()
    ):
        raise WeightsMismatchError(
            f"{folder} does not exist: pass a Hugging Face folder, a safetensors file or a glob."
        )
    if folder is not None and not isinstance(folder, (list, tuple)):
        hf = hf_config(folder)
        arch = _architecture(hf)
        if arch is not None:
            return for_architecture(arch, hf), f"key map {arch} (from config.json)"
    found = _for_model(model)
    if found is not None:
        return found[0], f"key map {found[1]}"
    raise WeightsMismatchError(
        f"no key_map given, and none is known for {type(model).__name__} or the folder {folder!r} (no "
        f"config.json with an architecture among {sorted(ARCHITECTURES)}): pass key_map=[(regex, target, "
        f"transform), ...]."
    )


def _family_of(folder: str | os.PathLike[str]) -> tuple[str, Family, dict[str, Any]]:
    path = Path(folder)
    if not path.is_dir():
        raise WeightsMismatchError(
            f"{folder} does not exist{' (it is a file)' if path.exists() else ''}: pass the folder that "
            "holds "
            f"the checkpoint's config.json and *.safetensors."
        )
    hf = hf_config(folder)
    if hf is None:
        raise WeightsMismatchError(f"{folder} has no config.json: pass a Hugging Face model folder.")
    arch = _architecture(hf)
    if arch not in ARCHITECTURES:
        raise WeightsMismatchError(f"{folder}/config.json: " + _unknown(str(arch)))
    return arch, ARCHITECTURES[arch], hf


def _model_module(family: Family) -> tuple[Any, type, type]:
    """The module holding the family's ModelConfig and class: tunix's, or nnx_shard's RoPE variant of it."""
    import importlib

    module = importlib.import_module(family.module)
    if family.module not in ROPE_MODELS:
        return module, getattr(module, family.cls), module.ModelConfig
    return (module, *rope_model(family.module))


def tunix_model(folder: str | os.PathLike[str], **overrides: Any) -> tuple[type, Any]:
    """The model class and its ``ModelConfig`` for a Hugging Face folder, read from its ``config.json``.

    Every field that changes the forward pass is carried into the config, or refused with
    :class:`~nnx_shard.errors.UnsupportedConfigError` naming it before any weight is read (the table on
    the fine-tuning page lists both, per family). The class is google-tunix's; for Llama 3, Mistral and
    Qwen 3 it is tunix's class with the checkpoint's RoPE applied (tunix's own always uses theta 1e6 and
    no scaling). ``overrides`` replace config fields (``shd_config=...``, ``remat_config=...``). Needs
    google-tunix (``pip install nnx-shard[hf]``).

    >>> tunix_model("no/such/folder")
    Traceback (most recent call last):
    ...
    nnx_shard.errors.WeightsMismatchError: no/such/folder does not exist: pass the folder that holds ...
    """
    arch, family, hf = _family_of(folder)
    module, cls, config_cls = _model_module(family)
    fields = family.config(module, hf, arch)
    names = {f.name for f in dataclasses.fields(config_cls)}
    lost = {k: v for k, v in fields.items() if k not in names and v is not None}
    if lost:
        raise WeightsMismatchError(
            f"{folder}: the installed google-tunix's {family.cls} ModelConfig has no field for "
            f"{sorted(lost)} "
            f"(values {lost}): install a google-tunix that has them (pip install -U google-tunix)."
        )
    fields = {k: v for k, v in fields.items() if k in names}
    fields.update(overrides)
    return cls, config_cls(**fields)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return bool(abs(a - b) <= 1e-9 * max(abs(a), abs(b)))
    return bool(a == b)


def check_model_config(model: Any, folder: str | os.PathLike[str]) -> None:
    """Raises when ``model`` (a tunix family's class) computes something other than ``folder``'s checkpoint.

    A model built by hand from tunix's presets, or from tunix's own Llama 3 / Qwen 3 class (RoPE theta
    always 1e6), would load without an error and give other logits; this names each field that differs.
    Models of other classes are left to their key map.
    """
    hf = hf_config(folder)
    arch = _architecture(hf)
    if hf is None or arch not in ARCHITECTURES or getattr(model, "config", None) is None:
        return
    family = ARCHITECTURES[arch]
    if not any(c.__name__ == family.cls and c.__module__ == family.module for c in type(model).__mro__):
        return
    import importlib

    want = family.config(importlib.import_module(family.module), hf, arch)  # refusals raise here
    config = model.config
    have = {k: getattr(config, k, None) for k in want}
    if family.module in ROPE_MODELS and not hasattr(config, "rope_kind"):  # tunix's own class
        have.update(rope_theta=1_000_000, rope_kind="default", rope_parameters=())
    wrong = [
        f"{k}: the model's {have[k]!r}, config.json's {v!r}"
        for k, v in want.items()
        if k != "param_dtype" and not _same(have[k], v)
    ]
    if wrong:
        raise WeightsMismatchError(
            f"{type(model).__name__} computes something other than {folder}'s checkpoint ({len(wrong)} "
            f"fields): {'; '.join(wrong[:6])}. Build it with `cls, config = "
            "ns.key_maps.tunix_model(folder)`, "
            f"which carries every field (tunix's own Llama3 and Qwen3 apply RoPE with theta 1e6 whatever "
            f"their config says). Nothing was read."
        )
