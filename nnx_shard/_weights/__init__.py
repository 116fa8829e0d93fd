"""Pretrained weights in and out: safetensors loads and saves, key-map transforms, LoRA and PEFT."""

from nnx_shard._weights._load import LoadReport, load_safetensors
from nnx_shard._weights._peft import save_peft_adapters
from nnx_shard._weights._save import save_safetensors

__all__ = [
    "LoadReport",
    "load_safetensors",
    "save_peft_adapters",
    "save_safetensors",
]
