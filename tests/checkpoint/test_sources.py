"""One restore, every source: the registry that resolves what a user passes, each kind through the same
call."""

from __future__ import annotations

import inspect
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import sources

STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def mesh(n: int = 8):
    return ns.create_mesh((n,), ("fsdp",), devices=jax.devices()[:n])


def kernel(model) -> np.ndarray:
    return np.asarray(model.kernel.get_value())


@pytest.fixture
def saved(tmp_path):
    """An nnx_shard checkpoint of a Linear (step 3), a plain Orbax one, a safetensors folder, and the
    values."""
    model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    with ns.Checkpointer(tmp_path / "ours", async_save=False) as ckpt:
        ckpt.save(3, {"model": model}, mesh=mesh())
    with ocp.CheckpointManager(tmp_path / "orbax") as manager:
        manager.save(5, args=ocp.args.StandardSave(nnx.state(model)))
        manager.wait_until_finished()
    from safetensors.numpy import save_file

    (tmp_path / "hf").mkdir()
    save_file(
        {"fc.weight": kernel(model).T.copy(), "fc.bias": np.asarray(model.bias.get_value())},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    return tmp_path, kernel(model)


def test_the_registry_asks_each_kind_in_order_and_names_what_it_takes(saved):
    root, _ = saved
    assert sources.registered() == [
        "safetensors",
        "nnx_shard checkpoint",
        "loaded state",
        "snapshots",
        "plain Orbax checkpoint",
    ]
    options = ns.RestoreOptions()
    assert isinstance(sources.as_source(root / "ours", options), sources.CheckpointSource)
    assert isinstance(sources.as_source(ns.Checkpointer(root / "ours"), options), sources.CheckpointSource)
    assert isinstance(sources.as_source(str(root / "orbax"), options), sources.OrbaxSource)
    assert isinstance(sources.as_source(root / "hf", options), sources.SafetensorsFolder)
    assert isinstance(sources.as_source({"model": {}}, options), sources.LoadedState)
    snaps = sources.Snapshots(None, 1, after=0)
    assert sources.as_source(snaps, options) is snaps
    with pytest.raises(ns.CheckpointFormatError, match=r"cannot restore from int 7.*kinds: safetensors, "):
        sources.as_source(7, options)


@pytest.mark.parametrize("kind", ["nnx_shard", "plain Orbax", "safetensors", "loaded state"])
def test_every_source_goes_through_the_same_restore_onto_another_mesh(saved, kind):
    root, want = saved
    given = {
        "nnx_shard": root / "ours",
        "plain Orbax": str(root / "orbax"),
        "safetensors": sources.SafetensorsFolder(
            root / "hf", [(r"fc\.weight", "kernel", "T"), (r"fc\.bias", "bias")]
        ),
        "loaded state": {"model": {"kernel": want, "bias": np.zeros(16, np.float32)}},
    }[kind]
    reports = []
    for restore in ("module", "hooks"):
        fresh = {"model": nnx.Linear(4, 16, rngs=nnx.Rngs(1))}
        assert not np.array_equal(kernel(fresh["model"]), want)
        if restore == "module":
            report = ns.restore_and_reshard(given, fresh, STRATEGY, mesh(4))
        else:
            hooks = ns.ShardingHooks(STRATEGY, mesh(4))
            hooks.adopt(fresh)
            report = hooks.restore_and_reshard(given)
            hooks.sync()
        np.testing.assert_array_equal(kernel(fresh["model"]), want)
        assert fresh["model"].kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        reports.append(str(report))
    assert reports[0] == reports[1]
    expected = {
        "nnx_shard": "restored step 3, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)",
        "plain Orbax": "restored step 5, item 'default' of a plain Orbax checkpoint onto 4 devices",
        "safetensors": f"restored the safetensors weights of {root / 'hf'} (2 tensors) onto 4 devices",
        "loaded state": "restored the loaded state onto 4 devices (fsdp=4)",
    }[kind]
    assert reports[0].startswith(expected), reports[0]


def test_a_source_a_user_registers_is_read_by_every_restore(saved, tmp_path):
    """An .npz file of a model's pure dict: the registry is open, the restore the same."""
    _, want = saved
    path = tmp_path / "weights.npz"
    np.savez(path, kernel=want, bias=np.zeros(16, np.float32))

    class Npz:
        collective, note, step = False, "", None

        def __init__(self, path):
            self.path = path

        def objects(self, live):
            return ["model"]

        def prepare(self, request):
            assert set(request.target) == {"model"}

        def read(self, request):
            data = dict(np.load(self.path))
            return sources.LoadedState({"model": data}).read(request)

        def describe(self):
            return f"the arrays of {self.path.name}"

        def complete(self, restored):
            return True

    sources.register_source(
        "npz", lambda obj: str(obj).endswith(".npz"), lambda obj, _: Npz(obj), before="safetensors"
    )
    try:
        assert sources.registered()[0] == "npz"
        fresh = {"model": nnx.Linear(4, 16, rngs=nnx.Rngs(1))}
        report = ns.restore_and_reshard(path, fresh, STRATEGY, mesh(2))
        assert str(report) == "restored the arrays of weights.npz onto 2 devices (fsdp=2)"
        np.testing.assert_array_equal(kernel(fresh["model"]), want)
    finally:
        sources.unregister_source("npz")
    assert "npz" not in sources.registered()


def test_the_three_restores_take_the_same_argument_names():
    names = lambda f: [
        p.name for p in inspect.signature(f).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    module, hooks = names(ns.restore_and_reshard), names(ns.ShardingHooks.restore_and_reshard)
    assert (
        module
        == hooks
        == ["step", "options", "only", "orbax_item", "ema_as_model", "free_live", "max_host_bytes", "frozen"]
    )
    fields = [f.name for f in __import__("dataclasses").fields(ns.RestoreOptions)]
    assert fields == module[2:]  # every keyword is an option, and the Trainer passes them on as options
    trainer = inspect.signature(ns.Trainer.restore_and_reshard).parameters
    assert list(trainer)[:4] == ["self", "source", "step", "options"]


def test_the_old_names_warn_and_still_restore(saved):
    root, want = saved
    fresh = {"model": nnx.Linear(4, 16, rngs=nnx.Rngs(1))}
    with pytest.warns(DeprecationWarning, match=r"items= is now only="):
        report = ns.restore_and_reshard(root / "ours", fresh, STRATEGY, mesh(4), items=["model"])
    assert report.step == 3
    with pytest.warns(DeprecationWarning, match=r"RestoreReport.items is now RestoreReport.only"):
        assert report.items is None
    with pytest.warns(DeprecationWarning, match=r"item= is now orbax_item="):
        ns.restore_and_reshard(str(root / "orbax"), fresh, STRATEGY, mesh(4), item="default")
    with pytest.warns(DeprecationWarning, match=r"state= is now the first argument, source"):
        ns.restore_and_reshard(None, fresh, STRATEGY, mesh(4), state={"model": {"kernel": want}})
    with pytest.warns(DeprecationWarning, match=r"checkpointer= is now the first argument"):
        hooks = ns.ShardingHooks(STRATEGY, mesh(4))
        hooks.adopt(fresh)
        hooks.restore_and_reshard(checkpointer=root / "ours")
    with pytest.warns(DeprecationWarning, match="RestoreOptions.item is now RestoreOptions.orbax_item"):
        assert ns.RestoreOptions(orbax_item="x").item == "x"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names say nothing
        ns.restore_and_reshard(root / "ours", fresh, STRATEGY, mesh(4), only=["model"])
    with pytest.raises(ns.ConflictingArgumentsError, match="got both items= and only="):
        ns.RestoreOptions(only=["model"], items=["model"])
    with pytest.raises(ns.ConflictingArgumentsError, match="reads one source; it got source, state"):
        ns.restore_and_reshard(root / "ours", fresh, STRATEGY, mesh(4), state={"model": {}})
    with pytest.raises(ns.CheckpointError, match="only= takes a sequence of object names"):
        ns.RestoreOptions(only="model")


def test_options_that_do_not_apply_to_a_source_are_refused_before_anything_changes(saved):
    root, want = saved
    fresh = {"model": nnx.Linear(4, 16, rngs=nnx.Rngs(1))}
    before = kernel(fresh["model"])
    with pytest.raises(
        ns.CheckpointFormatError, match="ema_as_model= applies to a checkpoint read from disk"
    ):
        ns.restore_and_reshard({"model": {"kernel": want}}, fresh, STRATEGY, mesh(4), ema_as_model=True)
    with pytest.raises(ns.CheckpointFormatError, match="safetensors source: restore it without"):
        ns.restore_and_reshard(root / "hf", fresh, STRATEGY, mesh(4), free_live=True)
    with pytest.raises(ns.CheckpointFormatError, match="written by plain Orbax"):
        ns.restore_and_reshard(str(root / "orbax"), fresh, STRATEGY, mesh(4), ema_as_model=True)
    with pytest.raises(ns.CheckpointError, match=r"only=\['ema'\] names no live object"):
        ns.restore_and_reshard(root / "ours", fresh, STRATEGY, mesh(4), only=["ema"])
    np.testing.assert_array_equal(kernel(fresh["model"]), before)


def test_the_trainer_restores_another_source_without_taking_its_step(saved, tmp_path):
    """A Trainer reading safetensors (a fine-tune's start): the weights land, the step and lineage stay."""
    import optax

    root, want = saved

    class Tiny(ns.Trainer):
        def create_model(self, rngs):
            return nnx.Linear(4, 16, rngs=rngs)

        def create_optimizer(self):
            return optax.sgd(0.1)

        def loss_fn(self, model, batch):
            return (model(batch) ** 2).mean()

    trainer = Tiny({"progress": "off", "sharding_strategy": STRATEGY, "workdir": str(tmp_path / "work")})
    folder = sources.SafetensorsFolder(root / "hf", [(r"fc\.weight", "kernel", "T"), (r"fc\.bias", "bias")])
    report = trainer.restore_and_reshard(folder, only=["model"])
    assert str(report).startswith("restored the safetensors weights of")
    np.testing.assert_array_equal(kernel(trainer.training_state["model"]), want)
    assert trainer.step == 0 and trainer.restored_step is None
