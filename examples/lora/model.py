"""A small Llama-style decoder in Flax NNX with LoRA on every projection, and its NumPy twin for checking
loads.

The layout follows Hugging Face's Llama: pre-norm blocks (RMSNorm), attention with rotary
position embeddings (the rotate-half form), a gated SiLU MLP, an untied ``lm_head``. Every
projection is an ``nnx.LoRALinear``: the base ``kernel`` is a plain ``nnx.Param`` (frozen when
fine-tuning), the adapters are ``nnx.LoRAParam`` (``lora_b`` starts at zero, so a fresh model
computes exactly what its base weights do).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    embed: int = 128
    heads: int = 8
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    rank: int = 8
    eps: float = 1e-5
    theta: float = 10000.0


def _rope(x, positions, theta):
    """Rotary embeddings, rotate-half form (Hugging Face's Llama): ``x`` is (..., seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (np.arange(half, dtype=np.float32) / half)
    angles = positions[:, None] * freqs[None, :]  # (seq, half)
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    rotated = (
        jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        if isinstance(x, jax.Array)
        else np.concatenate([-x[..., half:], x[..., :half]], -1)
    )
    return x * cos + rotated * sin


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        def lora(i: int, o: int) -> nnx.LoRALinear:
            return nnx.LoRALinear(i, o, lora_rank=cfg.rank, use_bias=False, rngs=rngs)

        inner = cfg.heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(cfg.embed, epsilon=cfg.eps, rngs=rngs)
        self.q, self.k, self.v = lora(cfg.embed, inner), lora(cfg.embed, inner), lora(cfg.embed, inner)
        self.o = lora(inner, cfg.embed)
        self.mlp_norm = nnx.RMSNorm(cfg.embed, epsilon=cfg.eps, rngs=rngs)
        self.gate, self.up = lora(cfg.embed, cfg.mlp), lora(cfg.embed, cfg.mlp)
        self.down = lora(cfg.mlp, cfg.embed)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, (b, t, _) = self.cfg, x.shape
        h = self.attn_norm(x)
        split = lambda y: y.reshape(b, t, cfg.heads, cfg.head_dim)
        pos = np.arange(t, dtype=np.float32)
        q, k, v = (
            _rope(split(self.q(h)), pos, cfg.theta),
            _rope(split(self.k(h)), pos, cfg.theta),
            split(self.v(h)),
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
        scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, -1)
        x = x + self.o(att)
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.embed, epsilon=cfg.eps, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.embed, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# Hugging Face's tensor names -> this model's paths; its Linear weights are (out, in), ours (in, out).
KEY_MAP = [
    (r"model\.embed_tokens\.weight", "embed/embedding"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", r"layers/\1/\2/kernel", "T"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers/\1/\2/kernel", "T"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers/\1/attn_norm/scale"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers/\1/mlp_norm/scale"),
    (r"model\.norm\.weight", "norm/scale"),
    (r"lm_head\.weight", "lm_head/kernel", "T"),
]


def numpy_forward(weights: dict[str, np.ndarray], tokens: np.ndarray, cfg: Config) -> np.ndarray:
    """The same decoder in NumPy, straight from Hugging Face-named weights: logits (batch, seq, vocab)."""

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * w

    b, t = tokens.shape
    x = weights["model.embed_tokens.weight"][tokens]
    pos = np.arange(t, dtype=np.float32)
    for i in range(cfg.layers):
        w = lambda n, i=i: weights[f"model.layers.{i}.{n}.weight"]
        h = norm(x, w("input_layernorm"))
        split = lambda y: y.reshape(b, t, cfg.heads, cfg.head_dim)
        q = _rope(split(h @ w("self_attn.q_proj").T), pos, cfg.theta)
        k = _rope(split(h @ w("self_attn.k_proj").T), pos, cfg.theta)
        v = split(h @ w("self_attn.v_proj").T)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -1e9)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = np.einsum("bhqk,bkhd->bqhd", scores / scores.sum(-1, keepdims=True), v).reshape(b, t, -1)
        x = x + att @ w("self_attn.o_proj").T
        h = norm(x, w("post_attention_layernorm"))
        gate = h @ w("mlp.gate_proj").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return norm(x, weights["model.norm.weight"]) @ weights["lm_head.weight"].T


def hf_weights(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Base weights in Hugging Face's names and (out, in) layout, float32, as a pretrained checkpoint has
    them."""
    rng = np.random.default_rng(seed)
    inner = cfg.heads * cfg.head_dim

    def dense(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    out = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab, cfg.embed)).astype(np.float32)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out.update({p + f"self_attn.{n}_proj.weight": dense(inner, cfg.embed) for n in "qkv"})
        out[p + "self_attn.o_proj.weight"] = dense(cfg.embed, inner)
        out[p + "mlp.gate_proj.weight"] = dense(cfg.mlp, cfg.embed)
        out[p + "mlp.up_proj.weight"] = dense(cfg.mlp, cfg.embed)
        out[p + "mlp.down_proj.weight"] = dense(cfg.embed, cfg.mlp)
        out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.embed)).astype(np.float32)
        out[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.embed)).astype(
            np.float32
        )
    out["model.norm.weight"] = np.ones(cfg.embed, np.float32)
    out["lm_head.weight"] = dense(cfg.vocab, cfg.embed)
    return out
