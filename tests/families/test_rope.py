"""RoPE as config.json states it: both writers' fields read alike, and the frequencies tunix's attention
gets."""

from __future__ import annotations

import numpy as np
import pytest

from nnx_shard._families import Rope, apply_rope, inverse_frequencies, rope_of


def test_4x_and_5x_fields_read_alike():
    v4 = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}
    v5 = {
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    }
    assert rope_of(v4) == rope_of(v5) == Rope(5e5, "llama3", (("factor", 8.0), ("low_freq_factor", 1.0)))
    gemma4 = {
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    gemma5 = {
        "rope_parameters": {
            "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
        }
    }
    for layer in ("full_attention", "sliding_attention"):
        assert rope_of(gemma4, layer) == rope_of(gemma5, layer)
    assert rope_of({}, default_theta=1e6) == Rope(1e6)


def test_llama3_frequencies_follow_the_published_rule():
    rope = Rope(
        5e5,
        "llama3",
        (
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 64),
        ),
    )
    base, scaled = inverse_frequencies(Rope(5e5), 16), inverse_frequencies(rope, 16)
    wavelen = 2 * np.pi / base
    high = wavelen < 64 / 4  # short waves: unchanged
    low = wavelen > 64 / 1  # long waves: divided by the factor
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8))


def test_default_rope_is_tunixs_to_the_last_bit():
    tunix = pytest.importorskip("tunix.models.llama3.model")
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 24, 4, 16)).astype(np.float32))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    theirs = tunix.apply_rope(x, pos, head_dim=16, rope_theta=1_000_000)
    ours = apply_rope(x, pos, 16, inv_freq=inverse_frequencies(Rope(1e6), 16))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=2e-6)
