"""Regenerates the tiny random Hugging Face checkpoints the tests load, with transformers and torch (CPU).

    pip install "torch==2.13.0" "transformers==4.51.3"   # the oldest supported writer, then
    pip install "torch==2.13.0" "transformers==5.24.0"   # the newest (no google-tunix needed to write)
    python tests/data/hf/make_tiny.py             # REAL into transformers-<version>/ (by that version)
    python tests/data/hf/make_tiny.py --legacy    # the six folders beside this file (written by 4.57.1)

REAL holds the values the checkpoints people download have, as each transformers writes them (4.x:
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``; 5.x: ``rope_parameters``, per layer type for
Gemma): Llama 3.1 (theta 5e5), Llama 3.2 (5e5, ``llama3`` scaling, tied), Mistral (no window), Qwen 2.5
(1e6, tied; and a bf16 copy), Qwen 3 (5e6, as the 2507 releases), Gemma, Gemma 2 (softcaps, a window of
8 over 24 tokens), Gemma 3 (6 layers: 5 sliding at 1e4, 1 global at 1e6 with linear scaling 8; and a bf16
copy). Each folder holds ``reference.safetensors``: the 2 x 24 token ids and torch's float32 logits (for a
bf16 copy, of the bf16 weights computed in float32). About 150-300 KB per folder.

One folder per family (``llama``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``), written by
``save_pretrained`` as the hub lays models out (several safetensors files and
``model.safetensors.index.json``), plus ``reference.safetensors``: the token ids and torch's float32 logits
for them. rope_theta is 1e6 for Llama and Qwen, the value google-tunix's attention uses whatever its config
says (Gemma's is 10,000 on both sides). About 150 KB per family.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = Path(__file__).parent
COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
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
            GEMMA,
            num_key_value_heads=2,
            query_pre_attn_scalar=16,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            attn_implementation="eager",
        ),
    ),
    # Gemma 3 (text): q/k norms, a local rope base; its first 5 of every 6 layers slide, as tunix's pattern
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            GEMMA,
            num_key_value_heads=1,
            query_pre_attn_scalar=16,
            sliding_window=16,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            attn_implementation="eager",
        ),
    ),
}
TOKENS = np.array([[1, 5, 9, 17, 33, 65, 127, 3], [2, 4, 8, 16, 32, 64, 100, 7]], np.int64)
REAL_TOKENS = np.stack([np.arange(24) * 5 % 127 + 1, np.arange(24)[::-1] * 3 % 120 + 2]).astype(np.int64)
LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # a short original context, so that the scaling changes frequencies 24 tokens use
REAL = {
    "llama31": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=500_000.0), None),
    "llama32": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=500_000.0,
            rope_scaling=LLAMA3_SCALING,
            tie_word_embeddings=True,
            max_position_embeddings=256,
        ),
        None,
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None), None),
    "qwen25": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True), None),
    "qwen25_bf16": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
        torch.bfloat16,
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=5_000_000.0), None),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, GEMMA, None),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            GEMMA,
            num_hidden_layers=4,
            num_key_value_heads=2,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            attn_implementation="eager",
        ),
        None,
    ),
}
_GEMMA3 = dict(
    GEMMA,
    num_hidden_layers=6,
    num_key_value_heads=1,
    query_pre_attn_scalar=16,
    sliding_window=8,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    attn_implementation="eager",
)
REAL["gemma3"] = (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, _GEMMA3, None)
REAL["gemma3_bf16"] = (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, _GEMMA3, torch.bfloat16)


def write(out: Path, config_cls, model_cls, kwargs: dict, dtype, tokens: np.ndarray) -> None:
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # larger weights than the default init, so a wrong layout shows in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        if dtype is not None:  # the reference computes in float32 with the weights as they are written
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
        logits = model(torch.tensor(tokens)).logits.float().numpy()
    shutil.rmtree(out, ignore_errors=True)
    # several files and an index, as hub models are; a bf16 copy cast as a whole (buffers stay as they are)
    (model if dtype is None else model.to(dtype)).save_pretrained(out, max_shard_size="40KB")
    save_file({"tokens": tokens.astype(np.int32), "logits": logits}, str(out / "reference.safetensors"))
    print(out, sorted(p.name for p in out.iterdir()))


def main() -> None:
    if "--legacy" not in sys.argv:
        for name, (config_cls, model_cls, extra, dtype) in REAL.items():
            out = HERE / f"transformers-{transformers.__version__}" / name
            write(out, config_cls, model_cls, {**COMMON, **extra}, dtype, REAL_TOKENS)
        return
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        write(HERE / name, config_cls, model_cls, {**COMMON, **extra}, None, TOKENS)


if __name__ == "__main__":
    main()
