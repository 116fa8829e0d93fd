"""Key maps for the model families users load from Hugging Face into google-tunix's classes.

A key map is the ordered ``(regex over file tensor names, target, transform)``
list that :func:`nnx_shard.load_safetensors` reads and
:func:`nnx_shard.save_safetensors` inverts. The maps here take a Hugging Face
folder (``config.json``'s ``architectures``) to tunix's ``Llama3``, ``Qwen2``
and ``Qwen3``: PyTorch's ``(out, in)`` weights transposed, attention
projections reshaped to tunix's ``(embed, heads, head_dim)`` einsum kernels by
the implied reshape (Hugging Face's q/k rows are already in the rotate-half
order tunix's RoPE uses: no permutation). Any other model takes an explicit
key map, as before.

>>> import nnx_shard as ns
>>> ns.key_maps.for_architecture("LlamaForCausalLM") is ns.key_maps.LLAMA3
True
>>> sorted(ns.key_maps.ARCHITECTURES)
['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM']
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nnx_shard._errors import WeightsMismatchError

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

#: ``config.json`` ``architectures`` -> (key map, tunix's module and class).
ARCHITECTURES: dict[str, tuple[list[Rule], str, str]] = {
    "LlamaForCausalLM": (LLAMA3, "tunix.models.llama3.model", "Llama3"),
    "Qwen2ForCausalLM": (QWEN2, "tunix.models.qwen2.model", "Qwen2"),
    "Qwen3ForCausalLM": (QWEN3, "tunix.models.qwen3.model", "Qwen3"),
}


def for_architecture(name: str) -> list[Rule]:
    """The key map of a Hugging Face architecture name (``config.json``'s ``architectures[0]``)."""
    if name not in ARCHITECTURES:
        raise WeightsMismatchError(
            f"no key map is shipped for the architecture {name!r} (shipped: {sorted(ARCHITECTURES)}); pass "
            f"key_map=[(regex over file tensor names, model path, transform), ...]."
        )
    return ARCHITECTURES[name][0]


def architecture_of(folder: str | os.PathLike[str]) -> str | None:
    """``config.json``'s first ``architectures`` entry in ``folder`` (None without one)."""
    config = Path(folder) / "config.json"
    if not Path(folder).is_dir() or not config.is_file():
        return None
    try:
        names = json.loads(config.read_text()).get("architectures") or []
    except (json.JSONDecodeError, OSError) as e:
        raise WeightsMismatchError(f"{config} is not readable JSON: {e}") from e
    return names[0] if names else None


def _for_model(model: Any) -> tuple[list[Rule], str] | None:
    for cls in type(model).__mro__:
        for arch, (rules, module, name) in ARCHITECTURES.items():
            if cls.__name__ == name and cls.__module__ == module:
                return rules, f"{arch} (from the model's class {module}.{name})"
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
            return for_architecture(arch), f"key map {arch} (from config.json)"
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
    Needs google-tunix (``pip install nnx-shard[lora]``).
    """
    import importlib

    arch = architecture_of(folder)
    if arch not in ARCHITECTURES:
        raise WeightsMismatchError(f"{folder} has no config.json architecture among {sorted(ARCHITECTURES)}.")
    _, module_name, class_name = ARCHITECTURES[arch]
    module = importlib.import_module(module_name)
    hf = json.loads((Path(folder) / "config.json").read_text())
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        rope_theta=int(hf.get("rope_theta", 10_000)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
    )
    tied = bool(hf.get("tie_word_embeddings", False))
    names = set(getattr(module.ModelConfig, "__dataclass_fields__", {}))
    for key in ("weight_tying", "use_tied_embedding"):
        if key in names:
            fields[key] = tied
    fields.update(overrides)
    return getattr(module, class_name), module.ModelConfig(**fields)
