"""Rules written for a memory budget: candidate layouts, their bytes and traffic, the suggestion that fits."""

from nnx_shard._base import parse_bytes
from nnx_shard._suggest._layouts import ACTIVATION_RESERVE, Layout, layouts
from nnx_shard._suggest._suggestion import Suggestion, choose, default_budget, suggest

__all__ = [
    "ACTIVATION_RESERVE",
    "Layout",
    "Suggestion",
    "choose",
    "default_budget",
    "layouts",
    "parse_bytes",
    "suggest",
]
