"""Hugging Face folders in and out: safetensors, PEFT adapters (the key maps are :mod:`nnx_shard.key_maps`).
``load_safetensors`` and ``save_safetensors`` are also at the top level."""

from nnx_shard._weights import LoadReport, load_safetensors, save_peft_adapters, save_safetensors

__all__ = ["LoadReport", "load_safetensors", "save_peft_adapters", "save_safetensors"]
