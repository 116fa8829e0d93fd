"""The one place that fakes devices: 8 simulated CPU devices for tests and doctests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
