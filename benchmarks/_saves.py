import os, sys, time, statistics, shutil, tempfile
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax
import orbax.checkpoint as ocp
import nnx_shard as ns
from common import stack_state_factory
STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
mesh = ns.create_mesh((1,), ("fsdp",))
hooks = ns.ShardingHooks(STRATEGY, mesh)
hooks.on_init(stack_state_factory(8, int(sys.argv[1])))
states = hooks.states(); jax.block_until_ready(states)
print("bytes", hooks.plan.total_bytes)
work = tempfile.mkdtemp(dir="/tmp")
res = {}
for k in range(4):
    for who in ("ours", "ours_noverify", "orbax"):
        d = f"{work}/{who}{k}"
        t = time.perf_counter()
        if who == "orbax":
            with ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)) as mgr:
                mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states)))
                mgr.wait_until_finished()
        else:
            with ns.Checkpointer(d, async_save=False, verify=(who == "ours")) as ckpt:
                hooks.save(ckpt, 1)
                ckpt.wait_until_finished()
        res.setdefault(who, []).append(time.perf_counter() - t)
        shutil.rmtree(d)
for who, v in res.items():
    print(who, [round(x, 3) for x in v], "median warm", round(statistics.median(v[1:]), 3))
print("ratio", round(statistics.median(res["ours"][1:]) / statistics.median(res["orbax"][1:]), 3),
      "noverify", round(statistics.median(res["ours_noverify"][1:]) / statistics.median(res["orbax"][1:]), 3))
shutil.rmtree(work)
