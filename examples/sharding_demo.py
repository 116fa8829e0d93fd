"""The main job until the ViT example lands: a model + nnx.Optimizer + nnx.EMA, sharded.

On 8 simulated CPU devices (or whatever devices JAX finds with --real-devices):
infer shardings from one strategy, print the plan, create the whole state
already sharded (jax.jit with out_shardings: no device ever holds an unsharded
copy of a sharded array), check the bytes each device really holds against
the plan, and take a few training steps.

    python examples/sharding_demo.py [--mesh dp:2,fsdp:4] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="dp:2,fsdp:4")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--real-devices", action="store_true", help="use the accelerators JAX finds")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    import jax

    if not args.real_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nnx_shard as ns
    from examples.toy_models import MLP

    mesh = ns.meshes.mesh_from_string(args.mesh)
    names = list(mesh.axis_names)
    strategy = [
        (".*embed.*", "replicate"),
        ("^head/kernel$", "shard_dim(axis='fsdp', dim=0)"),
        (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=1)"),
    ]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))

    def create():
        model = MLP(rngs=nnx.Rngs(0), vocab=512, width=1024, depth=4)
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param),
            "ema": nnx.EMA(model, decay=0.99),
        }

    abstract = nnx.eval_shape(create)
    shardings, plan = ns.infer_sharding(abstract, strategy, mesh, return_plan=True)
    print(f"== sharding plan on {jax.device_count()} devices ({ns.meshes.describe_mesh(mesh)})")
    print(plan.summary())
    print()
    print(plan.table(max_rows=14))

    # Sharded init: the state is created in place, never whole on one device.
    init_states = jax.jit(lambda: {k: nnx.state(o) for k, o in create().items()}, out_shardings=shardings)
    states = init_states()
    model, optimizer, ema = (
        nnx.merge(nnx.graphdef(abstract[k]), states[k]) for k in ("model", "optimizer", "ema")
    )

    per_device: dict = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    print(
        f"\n== placed: fullest device holds {ns.format_bytes(max(per_device.values()))} "
        f"(plan: {ns.format_bytes(plan.bytes_per_device)}); state {ns.format_bytes(plan.total_bytes)}"
    )

    @nnx.jit
    def train_step(model, optimizer, ema, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        ema.update(model)
        return loss

    data_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(names[0]))
    key = jax.random.key(1)
    print("== training")
    for step in range(args.steps):
        # A learnable toy task: each sequence counts up from a random start.
        start = jax.random.randint(jax.random.fold_in(key, step), (16, 1), 0, 480)
        tokens = jax.device_put(start + jnp.arange(17)[None, :], data_sharding)
        loss = train_step(model, optimizer, ema, tokens)
        print(f"step {step}: loss {float(loss):.3f}")
    kernel = nnx.state(optimizer)["opt_state"][1][0]["mu"]["layers"][0]["kernel"].get_value()
    print(f"adam mu of layers/0/kernel is still {kernel.sharding.spec} after training")


if __name__ == "__main__":
    main()
