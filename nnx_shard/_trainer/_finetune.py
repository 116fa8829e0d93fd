"""Fine-tuning: which parameters train (``Trainer.wrt``), and an EMA that starts from pretrained weights."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard._base import TrainingState, check_model, flatten_with_paths

logger = logging.getLogger("nnx_shard")


def resolve_wrt(wrt: Any, model: Any) -> Any:
    """``wrt`` when set; else ``nnx.LoRAParam`` when the model holds any (only the adapters train), else
    ``nnx.Param``. ``nnx.LoRAParam`` subclasses ``nnx.Param``, so ``nnx.Param`` would train the base too.

    >>> resolve_wrt(None, nnx.LoRALinear(2, 2, lora_rank=1, rngs=nnx.Rngs(0))) is nnx.LoRAParam
    True
    """
    check_model(model)
    if wrt is None:
        has_lora = any(isinstance(v, nnx.LoRAParam) for _, v in flatten_with_paths(nnx.state(model))[0])
        wrt = nnx.LoRAParam if has_lora else nnx.Param
    check_model(model, wrt=wrt)
    return wrt


def training_state(model: Any, tx: Any, wrt: Any, ema_decay: float | None) -> TrainingState:
    """A Trainer's state: the model, its ``nnx.Optimizer`` of ``wrt``, and the EMA of ``wrt`` (None without a
    decay)."""
    ema = nnx.EMA(model, decay=ema_decay, only=wrt) if ema_decay is not None else None
    return TrainingState(model, nnx.Optimizer(model, tx, wrt=wrt), ema)


def _count(n: int) -> str:
    for scale, unit in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def trainable_summary(model: Any, wrt: Any, chosen: bool, pretrained: bool) -> tuple[int, str]:
    """``(logging level, line)`` saying what trains: the count, its fraction and the filter that chose it.

    ``chosen``: ``Trainer.wrt`` was set; ``pretrained``: ``load_pretrained`` loaded weights. A fine-tune whose
    ``wrt`` fell back to every parameter (no LoRA parameter in the model) is a WARNING.

    >>> model = nnx.LoRALinear(100, 10, lora_rank=1, rngs=nnx.Rngs(0))
    >>> summary = trainable_summary(model, nnx.LoRAParam, False, True)
    >>> summary[1]
    'training 9.82% of 1.12 K parameters (110, nnx.LoRAParam: the LoRA adapters, by default)'
    """
    trained, rest = nnx.split_state(nnx.state(model, nnx.Param), wrt, ...)
    size = lambda state: sum(int(v.get_value().size) for _, v in flatten_with_paths(state)[0])
    n = size(trained)
    total = n + size(rest)
    name = getattr(wrt, "__name__", repr(wrt))
    if chosen:
        why = f"{_count(n)}, Trainer.wrt={name}"
    elif wrt is nnx.LoRAParam:
        why = f"{_count(n)}, nnx.LoRAParam: the LoRA adapters, by default"
    else:
        why = "every nnx.Param: the model holds no LoRA parameters"
    line = f"training {100 * n / max(total, 1):.3g}% of {_count(total)} parameters ({why})"
    if not chosen and wrt is nnx.Param and pretrained:
        return logging.WARNING, line + "; a LoRA provider that matched no module makes this a full fine-tune"
    return logging.INFO, line


def load_weights(
    load: Callable[[Any], Any],
    objects: dict[str, Any],
    wrt: Any,
    chosen: bool,
    announce: Callable[[int, str], None],
) -> None:
    """Runs the Trainer's ``load_pretrained`` on the new model (the EMA then starts from its weights) and
    announces what trains (:func:`trainable_summary`)."""
    pretrained = load(objects["model"]) is not None
    if pretrained and "ema" in objects:
        refresh_ema(objects["model"], objects["ema"])  # of the pretrained weights, not the random ones
    announce(*trainable_summary(objects["model"], wrt, chosen, pretrained))


def refresh_ema(model: Any, ema: Any) -> None:
    """Sets the EMA's parameters to the model's (fresh copies: the step donates both)."""
    values = {p.removeprefix("params/"): v for p, v in flatten_with_paths(nnx.state(ema))[0]}
    live = {p: v for p, v in flatten_with_paths(nnx.state(model))[0] if p in values}
    copies = jax.jit(lambda t: jax.tree.map(jnp.copy, t))({p: v.get_value() for p, v in live.items()})
    for p, variable in values.items():
        if p in copies:
            variable.set_value(copies[p])


def labels(model_state: Any, wrt: Any) -> dict[str, str]:
    """``{"model/<path>": "trainable" | "frozen"}`` for the model's parameters, as the plan labels them."""
    trainable, rest = nnx.split_state(model_state, wrt, ...)
    out = {f"model/{p}".removesuffix("/value"): "trainable" for p, _ in flatten_with_paths(trainable)[0]}
    for p, v in flatten_with_paths(rest)[0]:
        if isinstance(v, nnx.Param):
            out[f"model/{p}".removesuffix("/value")] = "frozen"
    return out


def frozen_filter(wrt: Any) -> Any:
    """The parameters ``wrt`` leaves out: what ``save_frozen=False`` keeps out of checkpoints."""
    return nnx.All(nnx.Param, nnx.Not(wrt))
