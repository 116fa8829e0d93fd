"""The shape of the code a newcomer meets: caches with one owner, a registry that does not leak, small
fixes."""

from __future__ import annotations

import doctest

import jax
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard._sharding import _parser as _tactic_parser
from tests.apps.trainer_app import RegressionTrainer, batch_for, config


def test_clear_caches_empties_every_cache_and_removes_the_compile_listener():
    from nnx_shard._base._caches import _CACHES, COMPILE_CLOCK

    src = jax.sharding.NamedSharding(ns.create_mesh((8,), ("fsdp",)), jax.P("fsdp"))
    dst = jax.sharding.NamedSharding(
        ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4]), jax.P("fsdp")
    )
    ns.reshard(jax.device_put(np.arange(4096.0), src), dst)  # compiles and caches a program
    COMPILE_CLOCK.stop()
    seconds = COMPILE_CLOCK.seconds
    jax.jit(lambda x: x + 1.5)(1.0)
    assert COMPILE_CLOCK.seconds == seconds and not COMPILE_CLOCK.listening  # reading registers nothing
    COMPILE_CLOCK.start()
    assert COMPILE_CLOCK.listening and sum(c.cache_info().currsize for c in _CACHES) > 0
    jax.jit(lambda x: x + 2.5)(1.0)
    assert COMPILE_CLOCK.seconds > seconds  # started: the compile is counted
    assert ns.clear_caches() > 0
    assert sum(c.cache_info().currsize for c in _CACHES) == 0 and not COMPILE_CLOCK.listening
    y = ns.reshard(jax.device_put(np.arange(4096.0), src), dst)  # rebuilt on next use
    assert np.array_equal(np.asarray(y), np.arange(4096.0))


def test_registering_a_tactic_in_a_doctest_does_not_leak():
    before = (
        ns.registered_tactics() if hasattr(ns, "registered_tactics") else _tactic_parser.registered_tactics()
    )
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = [t for t in finder.find(_tactic_parser) if t.name.endswith(".register_tactic")]
    assert runner.run(test, out=lambda s: None).failed == 0
    assert _tactic_parser.registered_tactics() == before and "first_dim" not in before
    with pytest.raises(
        ns.UnknownTacticError, match="cannot unregister tactic 'fsdp': it is a built-in tactic"
    ):
        ns.sharding.unregister_tactic("fsdp")


def test_the_plan_lists_the_model_first_and_max_rows_0_is_all(tmp_path):
    trainer = RegressionTrainer(config(str(tmp_path / "run"), total_steps=2))
    plan = trainer.plan
    tops = [p.path.split("/")[0] for p in plan.leaves]
    assert tops == sorted(tops, key=["model", "optimizer", "ema"].index)  # model, then its mirrors
    assert plan.table(max_rows=0) == plan.table() and "more leaves" not in plan.table(max_rows=0)


def test_on_log_gets_eval_metrics_and_save_steps_show_their_real_rate(tmp_path):
    seen = []

    class Logged(RegressionTrainer):
        def on_log(self, step, metrics):
            seen.append((step, dict(metrics)))

    cfg = {**config(str(tmp_path / "run"), total_steps=4), "save_every": 2, "eval_every": 2, "log_every": 1}
    trainer = Logged(cfg)
    history = trainer.train(batch_for, eval_data=lambda: [batch_for(100)])
    assert [s for s, m in seen if "eval_loss" in m] == [2, 4]  # the eval metrics of each eval step
    rates = {int(h["step"]): h.get("examples_per_s", 0.0) for h in history}
    assert all(rates[s] > 0 for s in (2, 3, 4)), rates  # save steps too


def test_logical_to_mesh_is_flaxs_own_rule_semantics():
    import flax.linen as nn
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from nnx_shard._sharding._logical import logical_to_mesh

    logical = st.sampled_from(["embed", "mlp", "heads", "vocab", "kv"])
    axes = st.sampled_from(["data", "model", "fsdp", ("data", "model")])

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.one_of(logical, st.none()), max_size=4), st.lists(st.tuples(logical, axes), max_size=6)
    )
    def same(names, rules):
        try:
            theirs = tuple(nn.logical_to_mesh_axes(tuple(names), tuple(rules)))
        except ValueError:
            with pytest.raises(ns.TacticArgumentError, match="occur more than once"):
                logical_to_mesh(tuple(names), tuple(rules))
            return
        assert logical_to_mesh(tuple(names), tuple(rules)) == theirs

    same()
