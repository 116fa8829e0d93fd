"""A Vision Transformer in Flax NNX (Dosovitskiy et al., 2021), from tiny up to ViT-H/14."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def linear(din: int, dout: int, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    """Parameters in float32, computation in ``dtype`` (bfloat16 halves activation memory and time)."""
    return nnx.Linear(din, dout, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def layer_norm(width: int, dtype: Any, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(width, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class Attention(nnx.Module):
    """Multi-head self-attention with 2-D kernels (query/key/value/out), easy to shard by tactic."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.heads = heads
        self.query = linear(width, width, dtype, rngs)
        self.key = linear(width, width, dtype, rngs)
        self.value = linear(width, width, dtype, rngs)
        self.out = linear(width, width, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, d // self.heads)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        attn = jax.nn.softmax(logits, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, n, d))


class MLPBlock(nnx.Module):
    def __init__(self, width: int, mlp: int, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.up = linear(width, mlp, dtype, rngs)
        self.down = linear(mlp, width, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, mlp: int, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.ln1 = layer_norm(width, dtype, rngs)
        self.attn = Attention(width, heads, rngs, dtype)
        self.ln2 = layer_norm(width, dtype, rngs)
        self.mlp = MLPBlock(width, mlp, rngs, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nnx.Module):
    """Patches -> linear embedding + class token + learned positions -> blocks -> head.

    Parameter paths: ``embed/kernel``, ``cls``, ``pos_emb``, ``blocks/3/attn/query/kernel``,
    ``blocks/3/mlp/up/kernel``, ``norm/scale``, ``head/kernel``. Parameters are float32;
    ``dtype`` is the compute dtype (``"bfloat16"`` for mixed precision).
    """

    def __init__(
        self,
        *,
        image_size: int,
        channels: int,
        patch: int,
        width: int,
        depth: int,
        heads: int,
        mlp: int,
        num_classes: int,
        rngs: nnx.Rngs,
        dtype: Any = "float32",
    ):
        if image_size % patch:
            raise ValueError(f"image_size {image_size} must be divisible by patch {patch}")
        self.patch = patch
        self.dtype = dtype = jnp.dtype(dtype)
        tokens = (image_size // patch) ** 2 + 1
        self.embed = linear(patch * patch * channels, width, dtype, rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, width)))
        self.pos_emb = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, tokens, width)))
        self.blocks = nnx.List([Block(width, heads, mlp, rngs, dtype) for _ in range(depth)])
        self.norm = layer_norm(width, dtype, rngs)
        self.head = linear(width, num_classes, dtype, rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = self.embed(x.astype(self.dtype))
        cls = jnp.broadcast_to(self.cls[...].astype(self.dtype), (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_emb[...].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])).astype(jnp.float32)  # the loss in float32
