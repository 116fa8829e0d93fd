"""The README's quickstart runs as written (with a small MyModel standing in for yours)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
from flax import nnx

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


class MyModel(nnx.Module):
    def __init__(self, rngs):
        self.embedding = nnx.Embed(16, 32, rngs=rngs)
        self.body = nnx.Linear(32, 64, rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)


def section(title: str) -> list[str]:
    text = README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_quickstart_runs_as_written():
    blocks = section("Quickstart")
    assert len(blocks) == 3
    namespace = {"MyModel": MyModel}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # our own README, not user input
    # What the README says: ^head/kernel$ also places the optimizer's and the EMA's copies.
    plan, p = namespace["plan"], jax.sharding.PartitionSpec
    for path in ("model/head/kernel", "optimizer/opt_state/0/mu/head/kernel", "ema/params/head/kernel"):
        assert plan.leaf(path).spec == p("fsdp", None), path
    assert plan.leaf("optimizer/opt_state/0/count").spec == p()
    ema = namespace["ema"]
    assert ema.params["head"]["kernel"].get_value().sharding.spec == p("fsdp", None)


def test_newest_idioms_section_runs_as_written(capsys):
    blocks = section("The newest JAX and Flax idioms")
    assert len(blocks) == 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # our own README, not user input
    out = capsys.readouterr().out
    assert "ns.auto_axes" in out.replace("nnx_shard.auto_axes", "ns.auto_axes")
    assert "item 'default' of a plain Orbax checkpoint onto 4 devices (fsdp=4)" in out
    p = jax.sharding.PartitionSpec
    model, fresh = namespace["model"], namespace["fresh"]
    assert fresh["model"].layers[0].kernel.get_value().sharding.mesh.devices.size == 4
    assert model.layers[0].kernel.get_value().sharding.spec == p(None, "fsdp")
    assert namespace["state"]["layers"][0]["kernel"].get_value().sharding.spec == p(None, "fsdp")
    assert float(namespace["loss"]) > 0
