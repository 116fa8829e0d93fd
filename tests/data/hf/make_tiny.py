"""Regenerates the tiny random Hugging Face checkpoints the tests load, with transformers and torch (CPU).

    pip install "torch==2.13.0" transformers
    python tests/data/hf/make_tiny.py

One folder per family (``llama``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``), written by ``save_pretrained`` as the hub lays
models out (several safetensors files and ``model.safetensors.index.json``), plus ``reference.safetensors``:
the token ids and torch's float32 logits for them. rope_theta is 1e6 for Llama and Qwen, the value
google-tunix's attention uses whatever its config says (Gemma's is 10,000 on both sides). About 150 KB per
family.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = Path(__file__).parent
COMMON = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=64,
)  # fmt: skip
GEMMA = dict(tie_word_embeddings=True, rope_theta=10_000.0, hidden_activation="gelu_pytorch_tanh")
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    # Gemma: 2 query heads, 1 kv head (tunix's q_einsum + kv_einsum); Gemma 2: 2 and 2 (its fused qkv_einsum),
    # softcaps, post norms, a sliding window longer than the tokens
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, GEMMA),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            GEMMA, num_key_value_heads=2, query_pre_attn_scalar=16, sliding_window=16,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attn_implementation="eager",
        ),
    ),
    # Gemma 3 (text): q/k norms, a local rope base; its first 5 of every 6 layers slide, as tunix's pattern
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            GEMMA, num_key_value_heads=1, query_pre_attn_scalar=16, sliding_window=16, rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0, attn_implementation="eager",
        ),
    ),
}  # fmt: skip
TOKENS = np.array([[1, 5, 9, 17, 33, 65, 127, 3], [2, 4, 8, 16, 32, 64, 100, 7]], np.int64)


def main() -> None:
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = config_cls(**{**COMMON, **extra})
        model = model_cls(config).eval()
        with torch.no_grad():  # larger weights than the default init, so a wrong layout shows in the logits
            for p in model.parameters():
                p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, max_shard_size="40KB")  # several files and an index, as hub models are
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS)).logits.float().numpy()
        save_file({"tokens": TOKENS.astype(np.int32), "logits": logits}, str(out / "reference.safetensors"))
        print(name, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
