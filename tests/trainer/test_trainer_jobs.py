"""The Trainer as unattended jobs meet it: config, headless logs, evaluation, best_metric, data resume,
endings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import nnx_shard as ns
from tests.apps.lm_app import LMTrainer, ResumableBatches, config, records, stack

ROOT = Path(__file__).resolve().parents[2]


def test_default_config_is_a_classmethod_that_subclasses_extend():
    base = ns.Trainer.default_config()
    assert isinstance(base, ml_collections.ConfigDict) and base.save_every == 0 and base.max_to_keep == 3
    assert LMTrainer.default_config().width == 32 and "width" not in base
    trainer = LMTrainer({**config(), "width": 16, "max_to_keep": 1, "async_save": False, "save_every": 5})
    assert trainer.config.width == 16 and trainer.config.max_to_keep == 1


def test_the_config_keys_renamed_to_the_checkpointers_names_still_work_with_a_deprecation_warning():
    old = {"keep": 1, "async_checkpoint": False, "verify_checkpoints": False, "free_live_on_restore": True}
    with pytest.warns(DeprecationWarning, match="config key 'keep' is now 'max_to_keep'"):
        trainer = LMTrainer({**{k: v for k, v in config().items() if k != "async_save"}, **old})
    cfg = trainer.config
    assert (cfg.max_to_keep, cfg.async_save, cfg.verify, cfg.free_live) == (1, False, False, True)
    assert "keep" not in cfg
    with pytest.raises(ns.ConfigError, match="'keep' and 'max_to_keep' both given"):
        LMTrainer({**config(), "keep": 1, "max_to_keep": 2})


def test_a_typo_in_the_config_is_refused_with_the_closest_keys():
    with pytest.raises(
        ns.UnknownConfigKeyError, match=r"unknown config key 'save_evry'; did you mean 'save_every'"
    ) as e:
        LMTrainer({**config(), "save_evry": 10})
    assert isinstance(e.value, ValueError) and "c = super().default_config()" in str(e.value)
    with pytest.raises(ns.UnknownConfigKeyError, match="unknown config key 'widht'; did you mean 'width'"):
        LMTrainer({**config(), "widht": 10})
    with pytest.raises(ns.ConfigError, match=r"config\.progress must be one of"):
        LMTrainer({**config(), "progress": "loud"})


def test_the_mesh_may_be_a_mesh_object_on_any_devices_order_and_axis_types():
    devices = jax.devices()[4:][::-1]
    mesh = Mesh(np.array(devices), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    trainer = LMTrainer(config(mesh=mesh))
    history = trainer.train(ResumableBatches(records(), batch=8), steps=2)
    kernel = trainer.states["model"]["mix"]["kernel"].get_value()
    assert list(kernel.sharding.mesh.devices.flat) == devices
    assert len(history) == 2 and np.isfinite(history[-1]["loss"])


def test_ema_off_is_a_setting(tmp_path):
    trainer = LMTrainer(config(str(tmp_path), ema_decay=None))
    trainer.train(ResumableBatches(records()), steps=2)
    assert set(trainer.states) == {"model", "optimizer"}
    assert trainer.checkpointer.items(2) == ["model", "optimizer"]
    again = LMTrainer(config(str(tmp_path), ema_decay=None))
    assert str(again.restore_and_reshard()).startswith("restored step 2, saved on 8 devices")
    assert "eval_loss" in again.evaluate([stack(records()[:8])])  # evaluates the model itself


def run_headless(workdir, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, "tests/apps/lm_app.py", str(workdir), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,  # stdout is a pipe, as in a cluster job
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_a_headless_run_prints_its_progress_to_stdout(tmp_path):
    out = run_headless(tmp_path)
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/3", "step 3/3"]  # log_every=2, and the last step
    fields = lines[0].split(" | ")
    assert (
        fields[1].startswith("loss ") and fields[2].startswith("lr ") and fields[3].startswith("grad_norm ")
    )
    assert (
        fields[-3].endswith("steps/s")
        and fields[-2].endswith("examples/s")
        and fields[-1].endswith("tokens/s")
    )
    assert "event compile:" in out and "event save:" in out and "event train:" in out and "goodput=" in out
    records_ = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records_ if "event" not in r]
    assert {"loss", "learning_rate", "grad_norm", "steps_per_s", "examples_per_s", "tokens_per_s"} <= set(
        steps[0]
    )
    assert steps[0]["learning_rate"] == pytest.approx(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 6)(1))
    assert steps[0]["tokens_per_s"] == pytest.approx(steps[0]["examples_per_s"] * 8)
    events = {r["event"] for r in records_ if "event" in r}
    assert {"compile", "save", "train"} <= events
    resumed = run_headless(tmp_path, "resume")
    assert "event restore:" in resumed and "step 6/6" in resumed
    tb = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert tb and all(f.stat().st_size > 0 for f in tb)


def test_evaluate_compiles_once_and_weights_batches_by_their_rows():
    trainer = LMTrainer(config())
    trainer.train(ResumableBatches(records()), steps=2)
    rows = records()
    small, large = stack(rows[:8]), stack(rows[8:32])
    first = trainer.evaluate([small, large])
    trainer.evaluate([small, large])
    trainer.evaluate([small, large], use_ema=True)
    assert (
        trainer.running.eval._fn._cache_size() == 2
    )  # one per batch signature (8 and 24 rows), not one per call
    whole = trainer.evaluate([stack(rows[:32])])
    assert first["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-5)  # 8 and 24 rows weighed as 32


class ScriptedEval(LMTrainer):
    """Eval losses scripted by step, to check which checkpoints best_metric keeps."""

    def evaluate(self, batches, *, use_ema=True):
        return {"eval_loss": {2: 0.9, 4: 0.3, 6: 0.5, 8: 0.7}[self.step]}


def test_best_metric_keeps_the_best_steps_and_names_the_best(tmp_path):
    trainer = ScriptedEval(
        config(str(tmp_path), max_to_keep=2, best_metric="eval_loss", save_every=2, eval_every=2)
    )
    trainer.train(ResumableBatches(records()), eval_data=lambda: [], steps=8)
    assert trainer.checkpointer.all_steps() == [4, 6, 8]  # the 2 best by eval_loss, and the latest to resume
    assert trainer.best_step() == 4
    assert trainer.checkpointer.manager.metadata(4).metrics == {"eval_loss": 0.3}


def losses(history):
    return [h["loss"] for h in history]


@pytest.mark.parametrize("kind", ["plain iterator", "grain"])
def test_data_resumes_where_it_stopped(tmp_path, kind):
    def data():
        if kind == "plain iterator":
            return ResumableBatches(records(), batch=8)
        grain = pytest.importorskip("grain", reason="install the data extra: pip install -e '.[data]'")
        return grain.MapDataset.source(records()).shuffle(seed=0).repeat().batch(8).to_iter_dataset()

    straight = LMTrainer(config())
    expected = losses(straight.train(data(), steps=6))
    first = LMTrainer(config(str(tmp_path)))
    first.train(data(), steps=3)  # ends with a save, the iterator's position with it
    assert first.checkpointer.metadata(3)["data_state"]
    resumed = LMTrainer(config(str(tmp_path)))
    resumed.restore_and_reshard()
    after = losses(resumed.train(data(), steps=3))  # a new iterator, set to where the first stopped
    np.testing.assert_allclose(after, expected[3:], rtol=1e-5)
    np.testing.assert_allclose(
        losses(LMTrainer(config()).train(lambda step: stack(records()[step * 8 : step * 8 + 8]), steps=2)),
        losses(LMTrainer(config()).train(lambda step: stack(records()[step * 8 : step * 8 + 8]), steps=2)),
    )  # a callable step -> batch keeps working


def test_a_finite_iterable_ends_the_run_cleanly_with_a_save(tmp_path):
    trainer = LMTrainer(config(str(tmp_path), total_steps=100))
    history = trainer.train([stack(records()[i * 8 : i * 8 + 8]) for i in range(3)])
    assert trainer.stop_reason == "data exhausted" and trainer.step == 3 and len(history) == 3
    assert trainer.checkpointer.latest_step() == 3
    trainer.train(ResumableBatches(records()), steps=2)
    assert trainer.stop_reason == "finished"


def test_resume_auto_restores_the_latest_checkpoint_before_training(tmp_path):
    LMTrainer(config(str(tmp_path))).train(ResumableBatches(records()), steps=4)
    trainer = LMTrainer(config(str(tmp_path), resume="auto", total_steps=6))
    history = trainer.train(ResumableBatches(records()))
    assert [h["step"] for h in history] == [5, 6]
    off = LMTrainer(config(str(tmp_path), total_steps=2))  # off by default: it never saves over them
    with pytest.raises(
        ns.CheckpointExistsError, match=r"already holds checkpoints of another run \(steps \[4, 6\]\)"
    ):
        off.train(ResumableBatches(records()))


def test_a_changed_batch_structure_is_a_clear_error():
    trainer = LMTrainer(config())
    batch = stack(records()[:8])
    trainer.train(lambda step: batch, steps=1)
    with pytest.raises(ns.BatchStructureError, match="the batch's structure changed between steps"):
        trainer.train(lambda step: {**batch, "extra": batch["target"]}, steps=1)
    trainer.train(lambda step: stack(records()[:16]), steps=1)  # other shapes recompile, no error


class Accumulating(LMTrainer):
    def create_optimizer(self):
        return optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)


def test_gradient_accumulation_with_multisteps_shards_accumulators_like_parameters():
    trainer = Accumulating(config())
    plan = trainer.plan
    param = plan.leaf("model/mix/kernel")
    accumulator = plan.leaf("optimizer/opt_state/acc_grads/mix/kernel")
    assert accumulator.spec == param.spec and accumulator.rule_index == param.rule_index
    kernel = lambda: np.asarray(trainer.states["model"]["mix"]["kernel"].get_value())
    before = kernel()
    trainer.train(ResumableBatches(records()), steps=1)
    np.testing.assert_array_equal(kernel(), before)  # accumulated, not applied yet
    trainer.train(ResumableBatches(records()), steps=1)
    assert not np.array_equal(kernel(), before)  # applied every 2 steps


def test_user_callbacks_run_every_n_steps_and_can_stop_the_run(tmp_path):
    trainer = LMTrainer(config(str(tmp_path), log_every=100, total_steps=20))
    seen = []

    def record(step, metrics, t):
        seen.append((step, round(metrics["loss"], 6)))
        if step == 6:
            t.request_stop("early stopping: patience ran out")

    trainer.add_callback(record, every=3)
    history = trainer.train(ResumableBatches(records()))
    assert [s for s, _ in seen] == [3, 6] and all(np.isfinite(v) for _, v in seen)
    assert trainer.stop_reason == "stopped: early stopping: patience ran out" and trainer.step == 6
    assert trainer.checkpointer.latest_step() == 6 and history[-1]["step"] == 6
    with pytest.raises(ns.ConfigError, match=r"add_callback\(every=\.\.\.\) takes a whole number"):
        trainer.add_callback(record, every=0)
    with pytest.warns(DeprecationWarning, match="Trainer.add_hook is now Trainer.add_callback"):
        trainer.add_hook(record, every=5)  # the old name still registers, and says the new one
    assert trainer.loop.callbacks[-1] == (record, 5)


def test_bf16_compute_with_float32_parameters_in_the_example_config():
    from examples.vit.config import get_config
    from examples.vit.model import ViT

    cfg = get_config("tiny,bf16")
    assert cfg.model.dtype == "bfloat16"
    model = ViT(**cfg.model, rngs=nnx.Rngs(0))
    assert model.blocks[0].attn.query.kernel.get_value().dtype == np.float32
    out = model(np.zeros((2, 8, 8, 1), np.float32))
    assert out.dtype == np.float32 and out.shape == (2, 10)


def test_the_logged_gradient_norm_is_the_global_norm():
    from nnx_shard._trainer._norm import global_norm

    mesh = ns.create_mesh((2, 4), ("dp", "fsdp"))
    model = nnx.Sequential(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    plan = ns.plan_sharding(
        model, [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh
    )
    shardings = {
        p.path: jax.sharding.NamedSharding(mesh, p.spec) for p in plan.leaves if p.path != "layers/1/bias"
    }
    state = jax.device_put(nnx.state(model), plan.shardings)
    ours = jax.jit(lambda g: global_norm(g, shardings, mesh))(
        state
    )  # a replicated leaf, and one it does not know
    assert float(ours) == pytest.approx(float(optax.tree.norm(state)), rel=1e-6)


def test_the_eval_line_says_which_weights_it_evaluated_and_a_config_key_chooses(tmp_path, capsys):
    evals = [stack(records()[:8])]
    for weights, ema_decay, shown in (
        ("ema", 0.999, "ema"),
        ("model", 0.999, "model"),
        ("ema", None, "model"),
    ):
        trainer = LMTrainer(
            config(
                str(tmp_path / f"{weights}{ema_decay}"),
                eval_every=2,
                progress="lines",
                ema_decay=ema_decay,
                eval_weights=weights,
            )
        )
        trainer.train(ResumableBatches(records()), steps=2, eval_data=lambda: evals)
        lines = [line for line in capsys.readouterr().out.splitlines() if "eval_loss" in line]
        assert lines and f"eval_loss ({shown}) " in lines[-1], lines
        want = trainer.evaluate(evals, use_ema=shown == "ema")["eval_loss"]
        assert trainer.last_eval["eval_loss"] == pytest.approx(want, rel=1e-6)
        logged = [json.loads(x) for x in (Path(trainer.workdir) / "metrics.jsonl").read_text().splitlines()]
        assert [r["eval_weights"] for r in logged if "eval_loss" in r] == [shown]
    with pytest.raises(ns.ConfigError, match=r"config\.eval_weights must be one of \('ema', 'model'\)"):
        LMTrainer({**config(), "eval_weights": "best"})


def test_the_trained_model_and_ema_are_read_only_views_of_the_live_objects(tmp_path):
    trainer = LMTrainer(config(str(tmp_path)))
    trainer.train(ResumableBatches(records()), steps=2)
    assert trainer.model is trainer.training_state["model"] and trainer.ema is trainer.training_state["ema"]
    kernel = trainer.states["model"]["mix"]["kernel"].get_value()
    np.testing.assert_array_equal(np.asarray(trainer.model.mix.kernel.get_value()), np.asarray(kernel))
    with pytest.raises(AttributeError, match="read-only view of the live model"):
        trainer.model = None
    assert LMTrainer(config(str(tmp_path / "b"), ema_decay=None)).ema is None
