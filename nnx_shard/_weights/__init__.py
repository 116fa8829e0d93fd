"""Pretrained weights in and out: safetensors loads and saves, key-map transforms, LoRA and PEFT."""
