"""infer_sharding against hand-computed specs, mirroring, strictness, and inputs of every kind."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.helpers import MLP, make_train_state, mesh_of

F = "fsdp(axis='fsdp', min_size_to_shard_mb=0)"

# (mesh, tactic, shape, dtype, expected spec, note fragment or None)
CASES = [
    ("8", F, (1024, 4096), "float32", (None, "fsdp"), None),
    ("8", F, (4096, 1024), "float32", ("fsdp", None), None),
    ("8", F, (512, 512), "float32", (None, "fsdp"), None),  # ties: the last dim
    ("8", F, (2, 3, 8), "bfloat16", (None, None, "fsdp"), None),
    ("8", F, (1001, 12), "float32", (None, None), "no free dimension"),
    ("8", F, (24,), "int8", ("fsdp",), None),
    ("8", "fsdp(axis='fsdp')", (1024, 1024), "float32", (None, None), "below min_size_to_shard_mb=4"),
    ("8", "fsdp(axis='fsdp')", (2048, 2048), "bfloat16", (None, "fsdp"), None),
    ("8", "fsdp(axis='fsdp')", (1024, 4096), "int8", (None, None), "below"),
    ("8", "fsdp(axis='fsdp', min_size_to_shard_mb=1)", (1024, 4096), "int8", (None, "fsdp"), None),
    ("1", F, (3, 5), "float32", (None, "fsdp"), None),
    ("1", "replicate", (3, 5), "float32", (None, None), None),
    ("2x4", F, (6, 8), "float32", (None, "fsdp"), None),
    (
        "2x4",
        "fsdp(axis=('dp', 'fsdp'), min_size_to_shard_mb=0)",
        (16, 24),
        "float32",
        (None, ("dp", "fsdp")),
        None,
    ),
    (
        "2x4",
        "fsdp(axis=('dp', 'fsdp'), min_size_to_shard_mb=0)",
        (12, 4),
        "float32",
        (None, None),
        "dp x fsdp=8".replace(" x ", "x"),
    ),
    ("2x4", F + "|shard_dim(axis='dp', dim=0)", (6, 8), "float32", ("dp", "fsdp"), None),
    ("2x4", "shard_dim(axis='dp', dim=0)|" + F, (6, 8), "float32", ("dp", "fsdp"), None),
    (
        "2x4",
        "shard_dim(axis='fsdp', dim=0)|" + F.replace("'fsdp'", "'dp'"),
        (8, 6),
        "float32",
        ("fsdp", "dp"),
        None,
    ),
    ("2x2x2", "shard_dim(axis='tp', dim=-1)", (4, 6), "float32", (None, "tp"), None),
    ("2x2x2", "spec('dp', 'tp')", (4, 6), "float32", ("dp", "tp"), None),
    ("2x2x2", "spec(('dp', 'fsdp'))", (8, 3), "bfloat16", (("dp", "fsdp"), None), None),
    ("2x2x2", F + "|shard_dim(axis='tp', dim=-1)", (8, 6), "float32", ("fsdp", "tp"), None),
    (
        "2x2x2",
        "fsdp(axis='fsdp', min_size_to_shard_mb=0)|fsdp(axis='tp', min_size_to_shard_mb=0)",
        (8, 6),
        "int8",
        ("fsdp", "tp"),
        None,
    ),
]


@pytest.mark.parametrize("mesh_key, tactic, shape, dtype, expected, note", CASES)
def test_table(mesh_key, tactic, shape, dtype, expected, note):
    mesh = mesh_of(mesh_key)
    state = {"w": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))}
    shardings, plan = ns.infer_sharding(state, [(".*", tactic)], mesh, return_plan=True)
    assert shardings["w"] == NamedSharding(mesh, P(*expected))
    leaf = plan.leaf("w")
    k = math.prod(
        math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) for e in expected if e
    )
    assert leaf.bytes_per_device == math.prod(shape) * jnp.dtype(dtype).itemsize // k
    if note:
        assert any(note in n for n in leaf.notes), leaf.notes
    else:
        assert leaf.notes == ()


def test_first_rule_wins_and_search_semantics():
    mesh = mesh_of("2x4")
    state = {
        "enc": {"attn": {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)}},
        "head": {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)},
    }
    strategy = [
        ("attn", "shard_dim(axis='dp', dim=0)"),
        ("kernel", "shard_dim(axis='fsdp', dim=1)"),
        (".*", "replicate"),
    ]
    with pytest.warns(ns.UnusedRuleWarning, match="rule 2"):
        s = ns.infer_sharding(state, strategy, mesh)
    assert s["enc"]["attn"]["kernel"].spec == P("dp", None)
    assert s["head"]["kernel"].spec == P(None, "fsdp")
    # Anchored rules match exact paths only.
    with pytest.warns(ns.UnusedRuleWarning, match="rule 0"):
        s = ns.infer_sharding(state, [("^kernel$", "shard_dim(axis='dp', dim=0)"), (".*", "replicate")], mesh)
    assert s["head"]["kernel"].spec == P(None, None)


ADAMW_CHAIN = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
MASKED = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.masked(optax.adamw(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
)


@pytest.mark.parametrize(
    "tx", [ADAMW_CHAIN, MASKED, optax.sgd(0.1, momentum=0.9)], ids=["chain", "masked", "sgd"]
)
def test_one_anchored_strategy_places_model_optimizer_and_ema(tx):
    mesh = mesh_of("2x4")
    model, opt, ema = make_train_state(tx)
    strategy = [
        ("^up/kernel$", "shard_dim(axis='fsdp', dim=-1)"),
        ("^layers/\\d+/kernel$", "shard_dim(axis='fsdp', dim=0)"),
        (".*", "replicate"),
    ]
    flat = {}
    for obj in (model, opt, ema):
        plan = ns.plan_sharding(obj, strategy, mesh)
        flat.update({p.path: p for p in plan.leaves})
    mirrors = [p for path, p in flat.items() if path.endswith("up/kernel")]
    assert len(mirrors) >= 3  # model, EMA, and at least one optimizer slot
    for p in mirrors:
        assert p.spec == P(None, "fsdp"), p.path
        assert p.rule_index == 0
    for path, p in flat.items():
        if path.endswith("layers/1/kernel"):
            assert p.spec == P("fsdp", None), path
        if path.endswith(("count", "step")):
            assert p.spec == P() and "scalar: replicated" in p.notes
    if tx is MASKED:
        skipped = [p for p in flat.values() if p.spec is None]
        assert skipped and all(p.path.endswith("bias") for p in skipped)
    assert "opt_state/1/0/mu/up/kernel" in flat or tx is not ADAMW_CHAIN


def test_rule_on_mirror_full_path_wins_when_first():
    mesh = mesh_of("8")
    _, opt, _ = make_train_state(ADAMW_CHAIN)
    strategy = [("/nu/", "replicate"), ("^up/kernel$", "shard_dim(axis='fsdp', dim=-1)"), (".*", "replicate")]
    s = ns.infer_sharding(opt, strategy, mesh)
    adam = s["opt_state"][1][0]
    assert adam["mu"]["up"]["kernel"].spec == P(None, "fsdp")
    assert adam["nu"]["up"]["kernel"].spec == P(None, None)


def test_grouped_states_match_paths_inside_each_object():
    mesh = mesh_of("8")
    model, opt, ema = make_train_state()
    s = ns.infer_sharding(
        {"model": model, "opt": opt, "ema": ema},
        [("^up/kernel$", "shard_dim(axis='fsdp', dim=-1)"), (".*", "replicate")],
        mesh,
    )
    assert s["model"]["up"]["kernel"].spec == P(None, "fsdp")
    assert s["ema"]["params"]["up"]["kernel"].spec == P(None, "fsdp")
    assert s["opt"]["opt_state"][0]["mu"]["up"]["kernel"].spec == P(None, "fsdp")


def test_inputs_of_every_kind_give_the_same_shardings():
    mesh = mesh_of("8")
    strategy = [(".*kernel", F), (".*", "replicate")]
    real = MLP(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    results = [
        ns.infer_sharding(real, strategy, mesh),
        ns.infer_sharding(nnx.state(real), strategy, mesh),
        ns.infer_sharding(abstract, strategy, mesh),
        ns.infer_sharding(nnx.state(abstract), strategy, mesh),
    ]
    for r in results:
        assert isinstance(r, nnx.State)
        assert jax.tree.leaves(r) == jax.tree.leaves(results[0])
    pure = nnx.to_pure_dict(nnx.state(real))
    plain = ns.infer_sharding(pure, strategy, mesh)
    assert isinstance(plain, dict)
    assert jax.tree.leaves(plain) == jax.tree.leaves(results[0])
    sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
    assert jax.tree.leaves(ns.infer_sharding(sds, strategy, mesh)) == jax.tree.leaves(results[0])


def test_abstract_inference_allocates_nothing():
    mesh = mesh_of("8")
    model, opt, ema = make_train_state()
    before = {id(a) for a in jax.live_arrays()}
    ns.infer_sharding((model, opt, ema), [(".*", F)], mesh)
    after = [a for a in jax.live_arrays() if id(a) not in before]
    assert after == []


def test_shardings_place_state_with_jit_and_device_put():
    mesh = mesh_of("2x4")

    def create():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, MASKED, wrt=nnx.Param)
        return nnx.state(model), nnx.state(opt), nnx.state(nnx.EMA(model, decay=0.9))

    shardings = ns.infer_sharding(jax.eval_shape(create), [(".*", F)], mesh)
    out = jax.jit(create, out_shardings=shardings)()
    leaves = jax.tree.leaves(out)
    targets = jax.tree.leaves(shardings)
    arrays = [x for x in leaves if hasattr(x, "sharding")]
    assert len(arrays) == len(targets)
    for x, s in zip(arrays, targets, strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    again = jax.device_put(out, shardings)
    assert jax.tree.leaves(again)[0].sharding == targets[0]


def test_strict_mode_lists_unmatched_leaves():
    mesh = mesh_of("8")
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    with pytest.raises(ns.UnmatchedLeavesError) as e:
        ns.infer_sharding(model, [("kernel", F)], mesh)
    text = str(e.value)
    assert "4 leaves match no rule" in text
    assert "emb/embedding (10, 16)" in text and "up/bias (32,)" in text
    assert "End the strategy with ('.*', 'replicate')" in text
    plan = ns.plan_sharding(model, [("kernel", F)], mesh, strict=False)
    assert plan.leaf("up/bias").spec == P(None)
    assert "no rule matched: replicated" in plan.leaf("up/bias").notes


def test_unused_rule_is_warned_and_reported():
    mesh = mesh_of("8")
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    with pytest.warns(ns.UnusedRuleWarning, match=r"rule 0 \('kernal', 'replicate'\) matched no leaf"):
        plan = ns.plan_sharding(model, [("kernal", "replicate"), (".*", F)], mesh)
    assert plan.unused_rules == [0]
    assert "matched nothing: typo?" in plan.summary()


def test_fsdp_fallback_is_logged_once(caplog):
    mesh = mesh_of("8")
    state = {f"w{i}": jax.ShapeDtypeStruct((7, 9), jnp.float32) for i in range(5)}
    with caplog.at_level("INFO", logger="nnx_shard"):
        ns.infer_sharding(state, [(".*", F)], mesh)
    records = [r for r in caplog.records if "no free dimension" in r.getMessage()]
    assert len(records) == 1
    assert "5 leaves left replicated" in records[0].getMessage()
    assert records[0].levelname == "WARNING"


@pytest.mark.parametrize(
    "make",
    [
        lambda s: list(s),
        lambda s: tuple(tuple(r) for r in s),
        lambda s: ml_collections.ConfigDict({"sharding_strategy": s}).sharding_strategy,
        lambda s: ml_collections.ConfigDict({"sharding_strategy": [list(r) for r in s]}).sharding_strategy,
    ],
    ids=["list", "tuple", "configdict", "configdict-lists"],
)
def test_strategy_containers(make):
    mesh = mesh_of("8")
    strategy = [(".*embedding.*", "replicate"), (".*", F)]
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    s = ns.infer_sharding(model, make(strategy), mesh)
    assert s["emb"]["embedding"].spec == P(None, None)
    assert s["up"]["kernel"].spec == P(None, "fsdp")


def test_annotated_uses_nnx_metadata_and_logical_rules():
    mesh = mesh_of("2x4")
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))

    def build():
        model = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    rules = [("embed", "dp"), ("mlp", "fsdp")]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model, opt = nnx.eval_shape(build)
    strategy = [(".*", f"annotated(rules={rules!r})")]
    s = ns.infer_sharding((model, opt), strategy, mesh)
    assert s[0]["kernel"].spec == P("dp", "fsdp")
    assert s[0]["bias"].spec == P(None)
    assert s[1]["opt_state"][0]["mu"]["kernel"].spec == P("dp", "fsdp")
    plan = ns.plan_sharding(model, strategy, mesh)
    assert "no sharding annotation" in plan.leaf("bias").notes[0]
    with pytest.raises(ns.MeshAxisError, match="names 'embed', which is not a mesh axis"):
        ns.infer_sharding(model, [(".*", "annotated()")], mesh)


def test_rule_instance_as_tactic():
    mesh = mesh_of("2x4")
    state = {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    s = ns.infer_sharding(state, [(".*", ns.compat.AutoShardingRule(mesh))], mesh)
    assert s["w"].spec == P(None, "dp")  # largest dim first, first axis that divides it
    assert s["b"].spec == P(None)


def test_callable_and_registered_tactics():
    mesh = mesh_of("8")

    def first_dim(cur_spec, mesh, name, leaf):
        assert leaf.value.shape == (16, 3)  # seed-style access to the abstract value
        return ("fsdp",) + tuple(cur_spec[1:])

    state = {"w": jax.ShapeDtypeStruct((16, 3), jnp.float32)}
    assert ns.infer_sharding(state, [(".*", first_dim)], mesh)["w"].spec == P("fsdp", None)

    @ns.sharding.register_tactic("last_dim_on")
    def last_dim_on(axis):
        return lambda cur, mesh, name, leaf: (*cur[:-1], axis)

    s = ns.infer_sharding(
        {"w": jax.ShapeDtypeStruct((3, 16), jnp.float32)}, [(".*", "last_dim_on(axis='fsdp')")], mesh
    )
    assert s["w"].spec == P(None, "fsdp")
    # A user tactic that returns an invalid spec is caught like a built-in one.
    with pytest.raises(ns.IndivisibleShardingError, match=r"cannot shard dim 1 of 'w' \(shape \(16, 3\)\)"):
        ns.infer_sharding(state, [(".*", lambda c, m, n, leaf: (None, "fsdp"))], mesh)


# -- the paths users write ------------------------


def test_a_rule_on_the_model_path_places_its_optimizer_and_ema_mirrors():
    mesh = mesh_of("8")
    model, opt, ema = make_train_state(ADAMW_CHAIN)
    grouped = {"model": model, "optimizer": opt, "ema": ema}
    strategy = [("^model/up/kernel$", "shard_dim(axis='fsdp', dim=0)"), (".*", "replicate")]
    plan = ns.plan_sharding(grouped, strategy, mesh)
    for path in (
        "model/up/kernel",
        "optimizer/opt_state/1/0/mu/up/kernel",
        "optimizer/opt_state/1/0/nu/up/kernel",
        "ema/params/up/kernel",
    ):
        assert plan.leaf(path).spec == P("fsdp", None), path
        assert plan.leaf(path).rule_index == 0, path
    assert plan.leaf("optimizer/opt_state/1/0/mu/up/kernel").matched == "model/up/kernel"
    # The same holds for states alone, as a Trainer holds them.
    states = {k: nnx.state(v) for k, v in grouped.items()}
    assert ns.infer_sharding(states, strategy, mesh)["ema"]["params"]["up"]["kernel"].spec == P("fsdp", None)


def test_mirroring_applies_to_optimizer_and_ema_state_only():
    mesh = ns.create_mesh((8,), ("data",))
    state = {"value": {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}}
    with pytest.warns(ns.UnusedRuleWarning):
        s = ns.infer_sharding(
            state, [("^w$", "replicate"), (".*", "fsdp(axis='data', min_size_to_shard_mb=0)")], mesh
        )
    assert s["value"]["w"].spec == P(None, "data")  # 'value' is no optimizer, so no mirror of 'w'
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)  # a plain optax state still mirrors
    s = ns.infer_sharding(
        {"params": params, "opt": opt_state},
        [("^w$", "replicate"), (".*", "fsdp(axis='data', min_size_to_shard_mb=0)")],
        mesh,
    )
    assert s["opt"][0].mu["w"].spec == P(None, None)


def test_a_chain_step_that_does_nothing_never_conflicts():
    mesh = ns.create_mesh((2, 4), ("data", "model"))
    state = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    chain = "shard_dim(axis='model', dim=-1)|fsdp(axis=('data','model'))"
    plan = ns.plan_sharding(state, [(".*", chain)], mesh)
    assert plan.leaf("w").spec == P(None, "model")
    assert any("below min_size_to_shard_mb" in n for n in plan.leaf("w").notes)
    big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}  # where fsdp would act, it still conflicts
    with pytest.raises(ns.ShardingConflictError, match="cannot use mesh axis 'model' again"):
        ns.infer_sharding(big, [(".*", chain)], mesh)


def test_logical_rules_with_fallbacks_skip_used_mesh_axes_like_flax():
    mesh = ns.create_mesh((2, 4), ("data", "model"))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0)))
    rules = [("embed", "data"), ("mlp", "data"), ("mlp", "model")]
    s = ns.infer_sharding(model, [(".*kernel", f"annotated(rules={rules!r})"), (".*", "replicate")], mesh)
    assert s["kernel"].spec == P("data", "model")
    with nnx.logical_axis_rules(rules):  # flax's own rules in context give the same
        s = ns.infer_sharding(model, [(".*kernel", "annotated()"), (".*", "replicate")], mesh)
    assert s["kernel"].spec == P("data", "model")
    # the rules are priorities, as in flax: embed takes data first, so mlp falls back to model
    assert ns.sharding.logical_to_mesh(("mlp", "embed"), tuple(rules)) == ("model", "data")


def test_ported_configs_shard_dim_ignore_ndim_error_and_trimmed_specs():
    mesh = mesh_of("2x4")
    state = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32), "b": jax.ShapeDtypeStruct((16,), jnp.float32)}
    plan = ns.plan_sharding(state, [(".*", "shard_dim(axis='dp', dim=1, ignore_ndim_error=True)")], mesh)
    assert plan.leaf("w").spec == P(None, "dp") and plan.leaf("b").spec == P(None)
    assert "shard_dim: skipped, dim 1 is not among its 1 dimensions" in plan.leaf("b").notes
    plan = ns.plan_sharding(state, [(".*", "spec('fsdp', None, None)")], mesh)
    assert plan.leaf("b").spec == P("fsdp")
    assert (
        "spec('fsdp', None, None): trimmed P('fsdp', None, None) to the leaf's 1 dimensions"
        in plan.leaf("b").notes
    )
    with pytest.raises(ns.TacticArgumentError, match=r"entries beyond dimension 0 name mesh axes P\('dp'\)"):
        ns.infer_sharding({"b": state["b"]}, [(".*", "spec('fsdp', 'dp')")], mesh)


class Block(nnx.Module):
    def __init__(self, rngs, annotate):
        init = nnx.initializers.lecun_normal()
        if annotate:
            init = nnx.with_partitioning(init, (None, None))
        self.lin = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)


class Scanned(nnx.Module):
    """16 layers of 8x8 stacked by nnx.vmap: the layer count is the largest dimension."""

    def __init__(self, rngs, annotate=True):
        @nnx.split_rngs(splits=16)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(rngs, annotate)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return jax.nn.relu(block.lin(x))

        return body(x, self.blocks)


def test_stacked_layers_keep_their_layer_axis_whole():
    mesh = mesh_of("8")
    strategy = [(".*kernel", F), (".*", "replicate")]

    def build(annotate):
        model = Scanned(nnx.Rngs(0), annotate)
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, decay=0.9, only=nnx.Param),
        }

    with nnx.use_eager_sharding(False):
        marked = nnx.eval_shape(lambda: build(True))
    plan = ns.plan_sharding(marked, strategy, mesh)  # NNX's own marking of the stacked axis is honoured
    for path in (
        "model/blocks/lin/kernel",
        "optimizer/opt_state/0/mu/blocks/lin/kernel",
        "ema/params/blocks/lin/kernel",
    ):
        assert plan.leaf(path).shape == (16, 8, 8)
        assert plan.leaf(path).spec == P(None, None, "fsdp"), path
    assert "dim 0 kept whole: stacked layer axis 'layers'" in plan.leaf("model/blocks/lin/kernel").notes
    plain = nnx.eval_shape(lambda: build(False))  # no annotation: fsdp would shard the layers
    assert ns.plan_sharding(plain, strategy, mesh).leaf("model/blocks/lin/kernel").spec == P(
        "fsdp", None, None
    )
    marked_by_rule = [(".*kernel", "stacked(dim=0)|" + F), (".*", "replicate")]  # unless the strategy says so
    plan = ns.plan_sharding(plain, marked_by_rule, mesh)
    assert plan.leaf("optimizer/opt_state/0/nu/blocks/lin/kernel").spec == P(None, None, "fsdp")
    with pytest.raises(ns.ShardingConflictError, match=r"dim 0 of .* is kept whole"):
        ns.infer_sharding(marked, [(".*kernel", "shard_dim(axis='fsdp', dim=0)"), (".*", "replicate")], mesh)
    objects, _ = ns.create_sharded(lambda: build(False), marked_by_rule, mesh)  # and it runs
    y = nnx.jit(lambda m, x: m(x))(objects["model"], jnp.ones((4, 8)))
    assert y.shape == (4, 8)


def test_a_factory_instead_of_its_abstract_state_is_refused_clearly():
    def create_fn():
        return MLP(nnx.Rngs(0))

    with pytest.raises(
        ns.StateTypeError, match=r"got the callable 'create_fn'. Pass nnx.eval_shape\(create_fn\)"
    ):
        ns.infer_sharding(create_fn, [(".*", F)], mesh_of("8"))
    with pytest.raises(TypeError):
        ns.infer_sharding(MLP, [(".*", F)], mesh_of("8"))


def test_notes_carry_their_kind_from_the_tactic_to_the_log(caplog):
    """Tactics hand notes over (``Noted``); the plan keeps their kind, and the log level comes from it."""
    import logging

    from nnx_shard._sharding import Note, Noted, NoteKind

    def halve(cur_spec, mesh, name, leaf):
        return Noted(cur_spec, (Note(NoteKind.NO_DIVISIBLE_DIM, "halve: replicated, odd rows"),))

    mesh = mesh_of("8")
    state = {
        "odd": jax.ShapeDtypeStruct((7, 5), jnp.float32),
        "tiny": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        "mine": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    strategy = [
        ("mine", ns.sharding.replicate() | halve),
        ("tiny", "fsdp(axis='fsdp', min_size_to_shard_mb=1)"),
    ]
    strategy += [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    with caplog.at_level(logging.INFO, logger="nnx_shard"):
        plan = ns.plan_sharding(state, strategy, mesh)
    kinds = {p.path: [n.kind for n in p.notes] for p in plan.leaves}
    assert kinds == {
        "odd": [NoteKind.NO_DIVISIBLE_DIM],
        "tiny": [NoteKind.BELOW_MIN_SIZE],
        "mine": [NoteKind.NO_DIVISIBLE_DIM],
        "step": [NoteKind.SCALAR],
    }
    assert plan.leaf("mine").notes == ("halve: replicated, odd rows",)  # a note is its text too
    levels = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records if "leaves" in r.getMessage()}
    assert levels["rule 0 ('mine', 'replicate()|halve')"] == logging.WARNING
    assert levels["rule 1 ('tiny', \"fsdp(axis='fsdp', min_size_to_shard_mb=1)\")"] == logging.INFO
    assert not any("step" in r.getMessage() for r in caplog.records)  # scalars are not logged
