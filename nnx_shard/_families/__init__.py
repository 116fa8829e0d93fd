"""Model families from Hugging Face: their configs read as transformers 4.x and 5.x write them, and tunix's
classes with the RoPE the checkpoint states."""

from nnx_shard._families._configs import TABLE, decoder, gemma, gemma3, head_dim, refuse
from nnx_shard._families._models import ROPE_MODELS, rope_model
from nnx_shard._families._rope import KINDS, Rope, apply_rope, inverse_frequencies, rope_of

__all__ = [
    "KINDS",
    "ROPE_MODELS",
    "TABLE",
    "Rope",
    "apply_rope",
    "decoder",
    "gemma",
    "gemma3",
    "head_dim",
    "inverse_frequencies",
    "refuse",
    "rope_model",
    "rope_of",
]
