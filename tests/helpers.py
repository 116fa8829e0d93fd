"""What tests share: meshes of 1, 8, 2x4 and 2x2x2 devices, a small model, and guards on transfers and
memory."""

from __future__ import annotations

import contextlib
import math

import jax
import optax
import pytest
from flax import nnx

import nnx_shard as ns


def no_host_transfers() -> contextlib.ExitStack:
    """Any transfer between host and device raises inside it, explicit ones included.

    (On the CPU backend ``jax.device_get`` passes even the strictest device-to-host guard, as nothing is
    copied; the host-to-device guard catches the ``device_put`` of host data any host round trip needs.)
    """
    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    return stack


def live_bytes_per_device() -> dict:
    """Bytes of ``jax.live_arrays()`` on each device, each buffer counted once."""
    seen, out = set(), {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            key = (s.device, s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def need_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(
            f"needs {n} devices, found {jax.device_count()}: run pytest from the repository root, "
            f"whose conftest.py simulates 8 CPU devices (or run `make test`)"
        )


MESHES = {
    "1": ((1,), ("fsdp",)),
    "8": ((8,), ("fsdp",)),
    "2x4": ((2, 4), ("dp", "fsdp")),
    "2x2x2": ((2, 2, 2), ("dp", "fsdp", "tp")),
}


def mesh_of(key: str):
    dims, names = MESHES[key]
    need_devices(math.prod(dims))
    return ns.create_mesh(dims, names, devices=jax.devices()[: math.prod(dims)])


class MLP(nnx.Module):
    """up -> layers[0..n) -> embedding; paths like up/kernel, layers/0/kernel."""

    def __init__(self, rngs: nnx.Rngs, din: int = 16, dh: int = 32, n: int = 2):
        self.up = nnx.Linear(din, dh, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(dh, dh, rngs=rngs) for _ in range(n)])
        self.emb = nnx.Embed(10, din, rngs=rngs)

    def __call__(self, x):
        x = self.up(x)
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def train_objects(tx=None) -> dict:
    """Model, optimizer and EMA of the MLP, built the way users build them (an ``on_init`` factory)."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx or optax.adamw(1e-3), wrt=nnx.Param)
    return {"model": model, "optimizer": optimizer, "ema": nnx.EMA(model, decay=0.99)}


def make_train_state(tx=None):
    """Abstract model, optimizer and EMA (a tuple) built the way users build them."""
    return nnx.eval_shape(lambda: tuple(train_objects(tx).values()))
