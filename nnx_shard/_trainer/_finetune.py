"""Fine-tuning: which parameters train (``Trainer.wrt``), and an EMA that starts from pretrained weights."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard._base import check_model, flatten_with_paths
from nnx_shard._checkpoint import storable, tree_fingerprints
from nnx_shard.errors import CheckpointError, CheckpointMismatchError

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


def states_to_save(
    states: dict[str, Any], wrt: Any, save_frozen: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """The states a checkpoint holds: without the frozen parameters when ``save_frozen`` is False, their
    fingerprints then going into ``extra`` (``frozen_fingerprints``) for the restore to check."""
    if save_frozen:
        return states
    frozen, rest = nnx.split_state(states["model"], frozen_filter(wrt), ...)
    extra["frozen_fingerprints"] = tree_fingerprints(storable(frozen)[0])
    return {**states, "model": rest}


def frozen_for_restore(checkpointer: Any, step: int | None, items: Any, live_model: Any, wrt: Any) -> Any:
    """The filter of the parameters ``step`` was saved without (None when it holds them all), once the live
    ones are the same weights it was trained on.

    Raises:
      CheckpointMismatchError: the live frozen parameters differ from those the checkpoint was saved with.
    """
    steps = checkpointer.all_steps()
    if (items and "model" not in items) or (step is None and not steps):
        return None  # the restore itself says there is nothing to read
    try:
        meta = checkpointer.metadata(steps[-1] if step is None else step)
    except CheckpointError:  # a missing or damaged step: the restore names it, its files checked first
        return None
    saved = meta.get("frozen_fingerprints")
    if saved is None:
        return None
    frozen = nnx.split_state(live_model, frozen_filter(wrt), ...)[0]
    live = tree_fingerprints(storable(frozen)[0])
    differ = sorted(p for p in set(saved) | set(live) if saved.get(p) != live.get(p))
    if differ:
        raise CheckpointMismatchError(
            f"step {meta.get('step')} was saved without its frozen parameters (save_frozen=False), and the "
            f"model's frozen parameters differ from the ones it was trained on: {differ[:8]}"
            f"{' ...' if len(differ) > 8 else ''}. Load the same base weights (Trainer.load_pretrained) first."
        )
    return frozen_filter(wrt)
