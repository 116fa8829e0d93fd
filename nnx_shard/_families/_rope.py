"""Rotary position embeddings as a checkpoint's ``config.json`` states them, in transformers 4.x and 5.x, and
their frequencies.

transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at the top level
(Gemma 3 adds ``rope_local_base_freq`` for its sliding layers); transformers 5.x
writes ``rope_parameters``, either one dict or one per layer type
(``{"full_attention": {...}, "sliding_attention": {...}}``). :func:`rope_of`
reads both into one :class:`Rope`; :func:`inverse_frequencies` computes what
transformers' ``ROPE_INIT_FUNCTIONS`` compute for the kinds a model here can
apply (``default``, ``linear``, ``llama3``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

#: The rope kinds whose frequencies :func:`inverse_frequencies` computes exactly.
KINDS = ("default", "linear", "llama3")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class Rope:
    """One attention's rotary embedding: the base ``theta``, the scaling ``kind`` and its parameters.

    >>> Rope(500_000.0, "llama3", (("factor", 32.0),)).parameter("factor")
    32.0
    """

    theta: float
    kind: str = "default"
    parameters: tuple[tuple[str, Any], ...] = ()

    def parameter(self, name: str, default: Any = None) -> Any:
        return dict(self.parameters).get(name, default)

    def __str__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.parameters)
        return f"rope {self.kind} (theta={self.theta:g}{extra})"


def _kind(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _from(params: dict[str, Any], theta: float) -> Rope:
    kind = _kind(params)
    rest = tuple(
        sorted(
            (k, v)
            for k, v in params.items()
            if k not in ("rope_type", "type", "rope_theta") and v is not None
        )
    )
    return Rope(float(params.get("rope_theta", theta)), kind, rest if kind != "default" else ())


def rope_of(
    hf: dict[str, Any], layer_type: str = "full_attention", *, default_theta: float = 10_000.0
) -> Rope:
    """The rope of ``layer_type``'s attention in a Hugging Face ``config.json`` dict, as 4.x or 5.x wrote it.

    ``default_theta`` is the family's theta when the file states none (transformers' class default).

    >>> rope_of({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    Rope(theta=1000000.0, kind='default', parameters=())
    >>> rope_of({"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    Rope(theta=500000.0, kind='linear', parameters=(('factor', 2.0),))
    >>> rope_of({"rope_theta": 1e6, "rope_local_base_freq": 1e4}, "sliding_attention").theta
    10000.0
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        if any(k in _LAYER_TYPES for k in params):  # 5.x, one dict per layer type
            params = params.get(layer_type) or params.get("full_attention") or {}
        return _from(params, hf.get("rope_theta", default_theta))
    scaling = hf.get("rope_scaling") or {}
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:  # 4.x Gemma 3: no scaling there
        return Rope(float(hf["rope_local_base_freq"]))
    return _from(scaling, float(hf.get("rope_theta", default_theta)))


def inverse_frequencies(rope: Rope, head_dim: int) -> np.ndarray:
    """The ``head_dim // 2`` inverse frequencies of ``rope``, as transformers computes them (float32).

    >>> inverse_frequencies(Rope(10_000.0), 4).tolist()
    [1.0, 0.009999999776482582]
    >>> inverse_frequencies(Rope(10_000.0, "linear", (("factor", 2.0),)), 4).tolist()
    [0.5, 0.004999999888241291]
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.kind == "linear":
        return (inv / np.float32(rope.parameter("factor"))).astype(np.float32)
    if rope.kind == "llama3":
        factor = rope.parameter("factor")
        low, high = rope.parameter("low_freq_factor"), rope.parameter("high_freq_factor")
        old = rope.parameter("original_max_position_embeddings")
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.kind != "default":
        raise ValueError(f"no frequencies for rope kind {rope.kind!r} (known: {KINDS})")
    return inv


def apply_rope(inputs: Any, positions: Any, head_dim: int, rope_theta: Any = None, *, inv_freq: Any) -> Any:
    """google-tunix's ``apply_rope`` (rotate-half, the same order of operations) with given inverse
    frequencies.

    ``head_dim`` and ``rope_theta`` are tunix's arguments, taken so that this replaces its function as called;
    the frequencies come from ``inv_freq`` alone.
    """
    import jax.numpy as jnp

    del head_dim, rope_theta
    angles = (
        positions[..., jnp.newaxis].astype(jnp.float32) * jnp.asarray(inv_freq)[jnp.newaxis, jnp.newaxis, :]
    )
    angles = angles[..., jnp.newaxis, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(inputs, 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(inputs.dtype)
