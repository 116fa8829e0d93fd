"""Fingerprints (``_checkpoint/_fingerprint``): the same on every sharding and every way of computing them,
and a changed word seen."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns

# How fingerprints are computed: by the devices' programs, in NumPy on the host (small arrays), or
# in place on CPU devices by marginal sums. Every way must give the same fingerprint.
PATHS = {
    "programs": (-1, False, "cpu"),
    "host": (2**20, False, "cpu"),
    "in place": (-1, True, "cpu"),
    "fused, all queued before any is read (as on GPUs)": (-1, False, "gpu"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint8", "int32", "bool"], ids=lambda d: d)
def test_a_fingerprint_does_not_depend_on_the_sharding_and_sees_one_changed_word(dtype, monkeypatch):
    from nnx_shard._checkpoint import _fingerprint
    from nnx_shard._checkpoint._fingerprint import fingerprints

    real_in_place = _fingerprint._in_place
    devices = np.array(jax.devices())
    bits = np.random.default_rng(0).integers(0, 256, (64, 24, 8 * np.dtype(dtype).itemsize), dtype=np.uint8)
    host = bits.view(dtype) if dtype != "bool" else bits % 2 == 1
    assert host.shape == (64, 24, 8)
    layouts = [
        NamedSharding(Mesh(devices, ("f",)), P("f")),
        NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", None, "a")),
        NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P(None, ("a", "b"))),
        NamedSharding(Mesh(devices[:3], ("r",)), P(None, "r")),
        NamedSharding(Mesh(devices[:1], ("one",)), P()),
        NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("a")),  # replicated over b: each block once
    ]
    prints, changed_prints = set(), set()
    changed = host.copy()
    if dtype == "bool":
        changed[40, 5, 3] = ~changed[40, 5, 3]
    else:
        changed[40, 5, 3:4].view(np.uint8)[0] ^= 1  # one bit of one word
    for host_bytes, in_place, platform in PATHS.values():
        monkeypatch.setattr(_fingerprint, "HOST_BYTES", host_bytes)
        monkeypatch.setattr(_fingerprint, "_in_place", real_in_place if in_place else lambda x: False)
        monkeypatch.setattr(_fingerprint, "_platform", lambda x, p=platform: p)
        monkeypatch.setattr(_fingerprint, "SMALL_BYTES", 0)  # no batching: each its own program
        prints |= set(fingerprints([jax.device_put(host, s) for s in layouts]))  # several at once
        prints.add(fingerprints([np.asarray(host)])[0])  # host data
        changed_prints.add(fingerprints([jax.device_put(changed, layouts[1])])[0])
    assert len(prints) == 1 and len(changed_prints) == 1
    assert changed_prints.isdisjoint(prints)
    # the shares of each layout's blocks, summed on the host where a snapshot writes them, give the same
    assert {block_shares(jax.device_put(host, s)) for s in layouts} == prints


def block_shares(x: jax.Array) -> str:
    """The fingerprint of ``x`` as the sum of its distinct blocks' shares (``block_fingerprint``)."""
    from nnx_shard._checkpoint._fingerprint_shares import block_fingerprint

    blocks = {
        tuple(s.start or 0 for s in shard.index): np.asarray(shard.data) for shard in x.addressable_shards
    }
    return f"{sum(block_fingerprint(d, start, x.shape) for start, d in blocks.items()) % 2**32:08x}"


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((8192,), P("f")),
        ((12288,), P()),
        ((48, 7), P("f")),
        ((8, 6, 5), P(None, "f")),
        ((40, 6), P(None, "f")),
    ],
    ids=str,
)
def test_fingerprints_agree_on_long_rows_and_odd_strides(shape, spec, monkeypatch):
    # One long row is summed as rows of up to 4096 words; an odd stride before the last dimension (the
    # (48, 7) and (8, 6, 5) cases) makes a word's parity depend on more than its last index.
    from nnx_shard._checkpoint import _fingerprint

    real_in_place, real_platform = _fingerprint._in_place, _fingerprint._platform
    devices = np.array(jax.devices())
    mesh = Mesh(devices[: 8 if spec == P("f") else 2], ("f",))
    host = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x = jax.device_put(host, NamedSharding(mesh, spec))
    got = set()
    for host_bytes, in_place, platform in PATHS.values():
        monkeypatch.setattr(_fingerprint, "HOST_BYTES", host_bytes)
        monkeypatch.setattr(_fingerprint, "_in_place", real_in_place if in_place else lambda x: False)
        monkeypatch.setattr(_fingerprint, "_platform", lambda x, p=platform: p)
        got.add(_fingerprint.fingerprints([x])[0])
    monkeypatch.setattr(_fingerprint, "_in_place", real_in_place)
    monkeypatch.setattr(_fingerprint, "_platform", real_platform)
    assert len(got) == 1 and got == {block_shares(x)}
    assert _fingerprint._in_place(x)  # summed where it lies, whatever its strides


def test_fingerprints_on_cpu_devices_compile_nothing(monkeypatch):
    # A first restore's verification on CPU devices compiles no program: small arrays (biases,
    # norm scales, counters) are summed on the host, large ones in place where they lie.
    import jax.numpy as jnp

    from nnx_shard._checkpoint import _fingerprint

    mesh = Mesh(np.array(jax.devices()), ("f",))
    small = [
        jax.device_put(jnp.arange(3072.0), NamedSharding(mesh, P())),
        jax.device_put(jnp.arange(4096, dtype=jnp.int8), NamedSharding(mesh, P("f"))),
        jnp.int32(7),
    ]
    large = jax.device_put(jnp.ones((512, 64)), NamedSharding(mesh, P("f")))
    ns.clear_caches()
    with jax.transfer_guard("disallow"):  # reading a CPU buffer in place is no transfer
        got = _fingerprint.fingerprints([*small, large])
    assert _fingerprint._program.cache_info().currsize == 0
    assert _fingerprint._shard_program.cache_info().currsize == 0
    monkeypatch.setattr(_fingerprint, "HOST_BYTES", -1)
    monkeypatch.setattr(_fingerprint, "_in_place", lambda x: False)
    assert got == _fingerprint.fingerprints([*small, large])  # the same as the devices' programs
    assert _fingerprint._shard_program.cache_info().currsize == 3  # what these paths spare: 3 compiles


def test_block_shares_of_scalars_and_key_data_add_up_to_the_fingerprint():
    import jax.numpy as jnp

    from nnx_shard._checkpoint._fingerprint import fingerprints

    for x in (jnp.int32(7), jnp.float32(-0.5), jax.random.key_data(jax.random.split(jax.random.key(0), 3))):
        assert block_shares(x) == fingerprints([x])[0], x


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "int8", "bool", "float64", "uint64", "int16"], ids=lambda d: d
)
def test_the_device_program_and_the_numpy_reference_give_the_same_share_of_every_block(dtype):
    """The sum is written twice, once traced for the devices (``block_share``) and once in NumPy
    (``block_fingerprint``): for blocks of every shape and place, scalars, 8-byte words and odd strides
    among them, the two agree; and the blocks' shares add up to the whole array's."""
    import jax.numpy as jnp

    from nnx_shard._checkpoint import block_base, block_fingerprint, block_share

    rng = np.random.default_rng(7)
    with jax.enable_x64(dtype in ("float64", "uint64")):
        for shape in [(), (5,), (9, 7), (4, 6, 5), (3, 1, 8)]:
            bits = rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
            host = bits.view(dtype).reshape(shape) if dtype != "bool" else (bits[..., 0] % 2 == 1)
            cuts = [(0, n // 2, n) for n in shape]
            total = 0
            for corner in np.ndindex(*[2] * len(shape)):
                box = tuple(slice(c[k], c[k + 1]) for c, k in zip(cuts, corner, strict=True))
                block, start = host[box], [c[k] for c, k in zip(cuts, corner, strict=True)]
                reference = block_fingerprint(block, start, shape)
                base = jnp.uint32(block_base(start, shape, block.dtype))
                device = int(jax.jit(lambda b, a, s=shape: block_share(b, a, s))(jnp.asarray(block), base))
                assert device == reference, (shape, start)
                total += reference
            assert total % 2**32 == block_fingerprint(host, [0] * len(shape), shape)
