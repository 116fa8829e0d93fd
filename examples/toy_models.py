"""Small factories for `nnx-shard plan` and the demo: an MLP and a Llama-shaped decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """An embedding, ``depth`` hidden layers and a head."""

    def __init__(self, *, rngs: nnx.Rngs, vocab: int = 512, width: int = 1024, depth: int = 4):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)


def mlp(*, rngs: nnx.Rngs, **kwargs: int) -> MLP:
    return MLP(rngs=rngs, **kwargs)


class DecoderLayer(nnx.Module):
    def __init__(self, d: int, ff: int, rngs: nnx.Rngs, kv: int | None = None):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        kv = kv or d  # grouped-query attention: the keys and values of fewer heads
        self.q, self.k, self.v, self.o = lin(d, d), lin(d, kv), lin(d, kv), lin(d, d)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.gate, self.up, self.down = lin(d, ff), lin(d, ff), lin(ff, d)
        self.heads = max(1, d // 64)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Causal attention (keys and values repeated over the query heads) and a SwiGLU MLP, pre-norm."""
        h = self.attn_norm(x)
        b, t, d = h.shape
        q = self.q(h).reshape(b, t, self.heads, -1)
        k, v = self.k(h), self.v(h)
        repeat = self.heads // (k.shape[-1] // q.shape[-1])
        k = jnp.repeat(k.reshape(b, t, -1, q.shape[-1]), repeat, axis=2)
        v = jnp.repeat(v.reshape(b, t, -1, q.shape[-1]), repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    """A Llama-shaped decoder: its parameter shapes (layout checks up to 70B) and a plain forward pass."""

    def __init__(self, *, rngs: nnx.Rngs, vocab: int, d: int, ff: int, layers: int, kv: int | None = None):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        # One Rngs per layer: a single shared Rngs makes nnx.eval_shape grow
        # faster than quadratically with depth on flax 0.12.
        self.layers = nnx.List([DecoderLayer(d, ff, nnx.Rngs(i), kv) for i in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits of the next token at each position: ``(batch, length) -> (batch, length, vocab)``."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


SIZES = {  # vocab, width, MLP, layers, key/value width (8 KV heads of 128 for 70b)
    "7b": (32000, 4096, 11008, 32, None),
    "70b": (128256, 8192, 28672, 80, 8 * 128),
    "tiny": (256, 64, 128, 2, None),
}


def llama(*, rngs: nnx.Rngs, size: str = "7b", layers: int | None = None) -> Llama:
    """``size`` is "7b" (6.7B parameters), "70b" (Llama-3-70B's shapes, 70.6B) or "tiny"; ``layers``
    overrides the depth."""
    vocab, d, ff, n, kv = SIZES[size]
    return Llama(rngs=rngs, vocab=vocab, d=d, ff=ff, layers=layers or n, kv=kv)


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["MLP", "Llama", "jnp", "llama", "mlp", "param_count"]


def optimizer():
    """An optimizer factory for ``nnx-shard plan --optimizer examples.toy_models:optimizer``."""
    import optax

    return optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), every_k_schedule=4
    )


def train_state(*, rngs: nnx.Rngs, **kwargs: int) -> dict:
    """The whole state of a run, as its training script builds it: model, optimizer (lion) and EMA."""
    import optax

    model = MLP(rngs=rngs, **kwargs)
    return {
        "model": model,
        "optimizer": nnx.Optimizer(model, optax.lion(1e-4), wrt=nnx.Param),
        "ema": nnx.EMA(model, decay=0.999, only=nnx.Param),
    }
