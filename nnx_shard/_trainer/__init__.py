"""The Trainer: configuration, the step, observability, data and checkpoints for a training job."""

from nnx_shard._trainer._config import default_config
from nnx_shard._trainer._trainer import Trainer

__all__ = [
    "Trainer",
    "default_config",
]
