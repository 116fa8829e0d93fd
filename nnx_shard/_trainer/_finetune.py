"""Fine-tuning: which parameters train (``Trainer.wrt``), and an EMA that starts from pretrained weights."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard._base import check_model, flatten_with_paths

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
        logger.info("training %s (Trainer.wrt)", "the LoRA adapters only" if has_lora else "every nnx.Param")
    check_model(model, wrt=wrt)
    return wrt


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
