"""LoRA adapters in PEFT's format, both ways: written for ``peft.PeftModel.from_pretrained``, read into a
model's adapters.

PEFT stores, per adapted ``nn.Linear`` named ``<module>`` in the Hugging Face
model, ``base_model.model.<module>.lora_A.weight`` (r, in) and
``lora_B.weight`` (out, r), and computes ``W + (lora_alpha / r) * B @ A`` on
the ``(out, in)`` weight. The model's adapters are mapped onto those through
the same key map as the weights: the base kernel's rule, inverted, says where
each element of the kernel sits in the ``(out, in)`` weight, so the adapter's
input axes become A's columns and its output axes B's rows, for einsum
kernels of any rank (a layout that mixes them is an error, never a guess).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_shard._weights._hf_folder import write_folder, writes_through_storage
from nnx_shard._weights._keys import Rule, file_shapes, host_value, key_rules, model_leaves, targets_of
from nnx_shard._weights._lora import Adapter, find_adapters
from nnx_shard._weights._transforms import full_ops, invert
from nnx_shard.errors import UnsupportedConfigError, WeightsMismatchError
from nnx_shard.key_maps import architecture_of, resolve_key_map

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model"
PREFIX = "base_model.model."


def is_peft_folder(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and (Path(path) / CONFIG).is_file()


def _layout(ad: Adapter, a_shape: tuple, b_shape: tuple, kernel_shape: tuple, ops: Any, file_shape: tuple):
    """``(a row of each input column, b column of each output row)`` of the ``(out, in)`` file weight."""
    a_str, rest = ad.equation.split(",")
    b_str, kernel = rest.split("->")
    if len(file_shape) != 2:
        raise WeightsMismatchError(f"{ad.base}: its file weight is {file_shape}, not PEFT's 2-D (out, in).")
    flat = np.arange(int(np.prod(kernel_shape))).reshape(kernel_shape)
    where = invert(ops, file_shape, flat)  # (out, in): the kernel's flat index of each element
    coords = np.unravel_index(where, kernel_shape)
    pick = lambda letters, shape: np.ravel_multi_index(tuple(coords[kernel.index(c)] for c in letters), shape)
    a_idx = pick(a_str[:-1], a_shape[:-1])
    b_idx = pick(b_str[1:], b_shape[1:])
    if not ((a_idx == a_idx[:1]).all() and (b_idx == b_idx[:, :1]).all()):
        raise WeightsMismatchError(
            f"{ad.base}: the adapter's input axes ({a_str[:-1]}) are not the columns of its {file_shape} "
            "file "
            f"weight (nor its output axes the rows), so it has no PEFT (A, B) form."
        )
    return a_idx[0], b_idx[:, 0]


def _sources(
    key_map: Sequence[Rule], names: dict[str, tuple[tuple[int, ...], str]], leaves: dict[str, Any]
) -> dict[str, tuple[str, Any, tuple[int, ...]]]:
    """``{model path: (file tensor name, full ops, file shape)}`` of the rules that fill one leaf whole."""
    rules = key_rules(key_map)
    out = {}
    for name, (shape, _) in names.items():
        match = next(((m, outs) for regex, outs in rules if (m := regex.fullmatch(name))), None)
        if match is None or len(match[1]) != 1:
            continue
        ((target, index, ops),) = targets_of(*match)
        if index or target not in leaves:
            continue
        out[target] = (name, full_ops(ops, shape, leaves[target].get_value().shape), tuple(shape))
    return out


def _source_shapes(like: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    if like is None:
        raise WeightsMismatchError(
            "PEFT adapters are named after the base model's weights: pass like= (the Hugging Face folder or "
            "files the model was loaded from)."
        )
    return file_shapes(like)


@writes_through_storage
def save_peft_adapters(
    model: Any,
    path: str | os.PathLike[str],
    key_map: Sequence[Rule] | None = None,
    *,
    like: str | os.PathLike[str] | Sequence[str] | None = None,
    base_model_name_or_path: str | None = None,
    lora_scale: float | None = None,
) -> list[str]:
    """Writes ``model``'s LoRA adapters as a PEFT folder: ``adapter_model.safetensors`` and
    ``adapter_config.json``.

    ``peft.PeftModel.from_pretrained(base, path)`` loads it onto the base
    ``transformers`` model, which then computes the JAX model's logits. The
    adapters (flax's, or qwix's on ``nnx.Linear``/``nnx.Einsum`` kernels) are
    named through ``key_map`` (chosen from ``like``'s ``config.json`` when not
    given); ``like`` is the Hugging Face folder the model was loaded from.
    The config holds ``r``, ``lora_alpha`` (``scale * r``, so PEFT's
    ``lora_alpha / r`` is the adapter's scale; ``rank_pattern`` and
    ``alpha_pattern`` where adapters differ), ``target_modules`` and the base
    model's name when known.

    Returns:
      The files written (by process 0; the others return an empty list).

    >>> import tempfile, numpy as np, nnx_shard as ns
    >>> from flax import nnx
    >>> from safetensors.numpy import save_file
    >>> src = tempfile.mkdtemp()
    >>> save_file({"fc.weight": np.zeros((3, 4), np.float32)}, f"{src}/model.safetensors")
    >>> model = nnx.LoRALinear(4, 3, lora_rank=2, use_bias=False, rngs=nnx.Rngs(0))
    >>> out = tempfile.mkdtemp()
    >>> written = ns.weights.save_peft_adapters(model, out, [(r"fc\\.weight", "kernel", "T")], like=src)
    >>> [f.split("/")[-1] for f in written]
    ['adapter_model.safetensors', 'adapter_config.json']
    """
    key_map, _ = resolve_key_map(key_map, model, like)
    leaves = model_leaves(model)
    adapters = find_adapters(model, lora_scale)
    if not adapters:
        raise WeightsMismatchError(
            f"{type(model).__name__} holds no LoRA adapters (flax's LoRALinear/LoRA or qwix's "
            f"apply_lora_to_model): there is nothing to write."
        )
    shapes = _source_shapes(like)
    sources = _sources(key_map, shapes, leaves)
    missing = sorted(set(adapters) - set(sources))
    if missing:
        raise WeightsMismatchError(
            "no key map rule names the weights of these adapted kernels as one whole file tensor: "
            f"{missing[:8]}; "
            f"PEFT adapters need one (a split or stacked rule has no PEFT name)."
        )
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for base, ad in sorted(adapters.items()):
        name, ops, file_shape = sources[base]
        a, b = host_value(leaves[ad.a].get_value()), host_value(leaves[ad.b].get_value())
        kernel = tuple(leaves[base].get_value().shape)
        cols, rows = _layout(ad, a.shape, b.shape, kernel, ops, file_shape)
        rank = a.shape[-1]
        module = name.removesuffix(".weight")
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank)[cols].T)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1)[:, rows].T)
        ranks[module], alphas[module] = rank, ad.scale * rank
    config = _config(ranks, alphas, shapes, like, base_model_name_or_path)
    if jax.process_index() != 0:
        return []
    files = write_folder(path, tensors, max_shard_size=2**62, prefix=WEIGHTS, index=False)
    (Path(path) / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [*files, str(Path(path) / CONFIG)]


def _config(
    ranks: dict[str, int],
    alphas: dict[str, float],
    shapes: dict[str, Any],
    like: Any,
    base_name: str | None,
) -> dict[str, Any]:
    """PEFT's LoraConfig as JSON: one r and lora_alpha, patterns for the adapters that differ."""
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    short = sorted({m.rsplit(".", 1)[-1] for m in ranks})
    everywhere = {
        n.removesuffix(".weight") for n in shapes if n.rsplit(".", 2)[-2] in short and n.endswith(".weight")
    }
    targets = short if everywhere == set(ranks) else sorted(ranks)
    folder = like if isinstance(like, (str, os.PathLike)) and Path(like).is_dir() else None
    if base_name is None and folder is not None:
        try:
            base_name = json.loads((Path(folder) / "config.json").read_text()).get("_name_or_path") or None
        except (OSError, json.JSONDecodeError):
            base_name = None
        base_name = base_name or str(Path(folder).resolve())
    arch = architecture_of(folder) if folder is not None else None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if arch and arch.endswith("ForCausalLM") else None,
        "base_model_name_or_path": base_name,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": targets,
        "rank_pattern": {m: v for m, v in ranks.items() if v != r},
        "alpha_pattern": {m: v for m, v in alphas.items() if v != alpha},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


#: PEFT config fields that change what the adapters compute, with the values that load exactly.
REFUSED = {
    "peft_type": ("LORA",),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "trainable_token_indices": (None, {}, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
}


def pattern_key(patterns: Sequence[str], module: str) -> str | None:
    r"""The first ``rank_pattern`` / ``alpha_pattern`` key that matches ``module`` as PEFT matches it: a regex
    against the end of the module's name, at a dot (``"v_proj"`` matches ``model.layers.0.self_attn.v_proj``).

    >>> pattern_key(["k_proj", "v_proj"], "model.layers.0.self_attn.v_proj")
    'v_proj'
    >>> pattern_key([r"layers\.1\..*"], "model.layers.0.self_attn.v_proj") is None
    True
    """
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)


def peft_scale(config: dict[str, Any], module: str) -> tuple[int, float]:
    """``(r, scale)`` PEFT gives ``module``: ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, patterns
    applied."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r_key, a_key = pattern_key(list(ranks), module), pattern_key(list(alphas), module)
    r = ranks[r_key] if r_key is not None else config.get("r", 8)
    alpha = alphas[a_key] if a_key is not None else config.get("lora_alpha", 8)
    return int(r), float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _check_config(path: Path, config: dict[str, Any]) -> None:
    for field, allowed in REFUSED.items():
        if field in config and config[field] not in allowed:
            raise UnsupportedConfigError(
                f"{path}: {field}={config[field]!r} changes what the adapters compute, and nnx_shard loads "
                f"plain LoRA (and rsLoRA) only ({field} must be {allowed[0]!r}). Nothing was written.",
                field=field,
                value=config[field],
            )


def load_peft_adapters(
    model: Any, folder: str | os.PathLike[str], key_map: Sequence[Rule]
) -> tuple[int, list[str]]:
    """Writes a PEFT folder's A and B into ``model``'s adapters in place; returns (tensors, notes).

    Every check (the config's fields, each module's rank and layout) runs before the first value is written.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsMismatchError(f"{folder / CONFIG} is not readable JSON: {e}") from e
    _check_config(folder / CONFIG, config)
    files = sorted(folder.glob(f"{WEIGHTS}*.safetensors"))
    try:
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    except (SafetensorError, OSError) as e:
        raise WeightsMismatchError(f"{folder}: the adapter weights are not readable safetensors: {e}") from e
    leaves = model_leaves(model)
    adapters = find_adapters(model)
    modules = sorted({k[len(PREFIX) :].rsplit(".lora_", 1)[0] for k in tensors if k.startswith(PREFIX)})
    shapes = {
        f"{m}.weight": (
            (tensors[f"{PREFIX}{m}.lora_B.weight"].shape[0], tensors[f"{PREFIX}{m}.lora_A.weight"].shape[1]),
            "",
        )
        for m in modules
    }
    where = _sources(key_map, shapes, leaves)
    sources = {name: path for path, (name, _, _) in where.items()}
    problems = [
        f"{m}: no adapter of the model matches it"
        for m in modules
        if sources.get(f"{m}.weight") not in adapters
    ]
    if problems:
        raise WeightsMismatchError(
            f"the PEFT adapters in {folder} do not fit the model; nothing was written: {problems[:8]}"
        )
    notes: list[str] = []
    writes = [
        w
        for m in modules
        for w in _prepare(
            m, adapters[sources[f"{m}.weight"]], leaves, where[sources[f"{m}.weight"]], tensors, config, notes
        )
    ]
    for var, value in writes:  # all checked: now written
        x = var.get_value()
        var.set_value(jax.make_array_from_callback(x.shape, x.sharding, lambda idx, v=value: v[idx]))
    if config.get("use_rslora"):
        notes.append("rsLoRA: scale lora_alpha / sqrt(r)")
    return 2 * len(modules), notes


def _prepare(
    m: str, ad: Adapter, leaves: dict[str, Any], where: Any, tensors: dict, config: dict, notes: list
) -> list[tuple[Any, np.ndarray]]:
    """PEFT module ``m``'s A and B as the values of the adapter ``ad`` (B rescaled when PEFT's scale
    differs)."""
    base = ad.base
    _, ops, file_shape = where
    A, B = tensors[f"{PREFIX}{m}.lora_A.weight"], tensors[f"{PREFIX}{m}.lora_B.weight"]
    rank = A.shape[0]
    r, peft = peft_scale(config, m)
    a_var, b_var = leaves[ad.a], leaves[ad.b]
    a_shape, b_shape = tuple(a_var.get_value().shape), tuple(b_var.get_value().shape)
    if rank != r:
        raise WeightsMismatchError(
            f"{m}: its lora_A holds rank {rank}, the adapter config gives it r={r} (r, rank_pattern); "
            "nothing "
            f"was written."
        )
    if a_shape[-1] != rank:
        raise WeightsMismatchError(
            f"{m}: PEFT rank {rank}, the model's adapter rank {a_shape[-1]}: create the model's LoRA with "
            f"rank {rank} for it (a qwix LoraProvider per rank); nothing was written."
        )
    cols, rows = _layout(ad, a_shape, b_shape, tuple(leaves[base].get_value().shape), ops, file_shape)
    a2 = np.empty((int(np.prod(a_shape[:-1])), rank), A.dtype)
    a2[cols] = A.T
    b2 = np.empty((rank, int(np.prod(b_shape[1:]))), B.dtype)
    b2[:, rows] = B.T
    if not np.isclose(peft, ad.scale):
        b2 = b2 * (peft / ad.scale)
        notes.append(
            f"{m}: B scaled by {peft / ad.scale:g} (PEFT's scale {peft:g}, the model's {ad.scale:g})"
        )
    dtype = lambda var: var.get_value().dtype
    return [
        (a_var, a2.reshape(a_shape).astype(dtype(a_var))),
        (b_var, b2.reshape(b_shape).astype(dtype(b_var))),
    ]
