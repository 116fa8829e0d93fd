"""Tactic strings: the safe parser, chaining, and every error with its text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import nnx_shard as ns
from tests.helpers import mesh_of

W = {"encoder": {"mlp": {"kernel": jax.ShapeDtypeStruct((6, 10), jnp.float32)}}}


def run(tactic, mesh_key="2x4", state=W):
    return ns.infer_sharding(state, [(".*", tactic)], mesh_of(mesh_key))


@pytest.mark.parametrize(
    "tactic, error, fragments",
    [
        (
            "fsdpp(axis='fsdp')",
            ns.UnknownTacticError,
            ["rule 0 ('.*', \"fsdpp(axis='fsdp')\")", "unknown tactic 'fsdpp'", "register_tactic"],
        ),
        (
            "fsdp(axes='fsdp')",
            ns.TacticArgumentError,
            ["unexpected keyword argument 'axes'", "it takes fsdp(axis, min_size_to_shard_mb=4)"],
        ),
        ("shard_dim(axis='tp')", ns.TacticArgumentError, ["missing a required argument: 'dim'"]),
        ("shard_dim(axis='fsdp', dim='last')", ns.TacticArgumentError, ["takes an integer; got 'last'"]),
        ("fsdp(axis=3)", ns.TacticArgumentError, ["takes a mesh axis name or a tuple of names; got 3"]),
        ("fsdp(axis='fsdp', min_size_to_shard_mb=-1)", ns.TacticArgumentError, ["a number >= 0"]),
        (
            "fsdp(axis='model')",
            ns.MeshAxisError,
            [
                "'encoder/mlp/kernel' (shape (6, 10))",
                "mesh axis 'model' is not in the mesh",
                "('dp', 'fsdp')",
            ],
        ),
        (
            "shard_dim(axis='fsdp', dim=-1)",
            ns.IndivisibleShardingError,
            [
                "cannot shard dim -1 of 'encoder/mlp/kernel' (shape (6, 10)) over fsdp=4: 10 is not "
                "divisible by 4",
                "use fsdp()",
            ],
        ),
        (
            "shard_dim(axis='fsdp', dim=2)",
            ns.TacticArgumentError,
            ["cannot shard dim 2", "it has 2 dimensions"],
        ),
        ("spec('fsdp')", ns.IndivisibleShardingError, ["6 is not divisible by 4"]),
        ("spec('dp', 'fsdp', 'tp')", ns.TacticArgumentError, ["gives 3 spec entries"]),
        ("spec(None, 'tp')", ns.MeshAxisError, ["mesh axis 'tp' is not in the mesh"]),
        (
            "shard_dim(axis='dp', dim=0)|replicate()",
            ns.ShardingConflictError,
            [
                "cannot replicate 'encoder/mlp/kernel' (shape (6, 10)): it is already P('dp', None)",
                "Put the more specific rule first",
            ],
        ),
        (
            "shard_dim(axis='dp', dim=0)|shard_dim(axis='fsdp', dim=0)",
            ns.ShardingConflictError,
            ["cannot shard dim 0", "already P('dp', None)"],
        ),
        (
            "shard_dim(axis='dp', dim=0)|shard_dim(axis='dp', dim=1)",
            ns.ShardingConflictError,
            ["cannot use mesh axis 'dp' again"],
        ),
        ("spec(('dp', 'dp'))", ns.ShardingConflictError, ["uses mesh axis 'dp' twice"]),
        ("shard_dim(axis='dp', dim=0)|spec('dp')", ns.ShardingConflictError, ["spec() sets the whole spec"]),
    ],
)
def test_errors_name_rule_leaf_and_fix(tactic, error, fragments):
    with pytest.raises(error) as e:
        run(tactic)
    text = str(e.value)
    for f in fragments:
        assert f in text, text
    assert text.startswith("rule 0 ")
    assert isinstance(e.value, ValueError)


def test_style_guide_message():
    state = {
        "encoder": {"layers": {"0": {"mlp": {"kernel": jax.ShapeDtypeStruct((768, 3072), jnp.float32)}}}}
    }
    strategy = [
        (".*/bias", "replicate"),
        (".*/kernel", "fsdp(axis='fsdp', min_size_to_shard_mb=0)|shard_dim(axis='fsdp', dim=-1)"),
    ]
    with pytest.raises(ns.ShardingConflictError) as e:
        ns.infer_sharding(state, strategy, mesh_of("2x4"))
    assert str(e.value) == (
        "rule 1 ('.*/kernel', \"fsdp(axis='fsdp', min_size_to_shard_mb=0)|shard_dim(axis='fsdp', dim=-1)\") "
        "cannot shard dim -1 of 'encoder/layers/0/mlp/kernel' (shape (768, 3072)): it is already "
        "P(None, 'fsdp'). Put the more specific rule first, or drop one tactic."
    )


@pytest.mark.parametrize(
    "text",
    [
        "fsdp(axis=__import__('os').system('touch {marker}'))",
        "__import__('os').system('touch {marker}')",
        "fsdp(axis='fsdp')|open('{marker}', 'w')",
        "fsdp(axis=[c for c in open('{marker}', 'w')])",
        "(lambda: open('{marker}', 'w'))()",
        "fsdp(axis='fsdp'); open('{marker}', 'w')",
        "fsdp(**{{'axis': open('{marker}', 'w')}})",
        "os.system('touch {marker}')",
        'fsdp(axis=f\'{{open("{marker}", "w")}}\')',
    ],
)
def test_tactic_strings_never_run_code(tmp_path, text):
    marker = tmp_path / "ran"
    with pytest.raises(ns.TacticError) as e:
        run(text.format(marker=marker))
    assert isinstance(e.value, (ns.TacticSyntaxError, ns.UnknownTacticError))
    assert not marker.exists()


def test_parser_accepts_bare_names_tuples_and_whitespace():
    t = ns.sharding.parse_tactic("  replicate  ")
    assert str(t) == "replicate()"
    chain = ns.sharding.parse_tactic(
        "fsdp(axis=('dp','fsdp'), min_size_to_shard_mb=0) | shard_dim(axis='tp', dim=-1)"
    )
    assert str(chain) == "fsdp(axis=('dp', 'fsdp'), min_size_to_shard_mb=0)|shard_dim(axis='tp', dim=-1)"
    # A tactic object and its text place leaves the same way.
    a = run(ns.sharding.fsdp("fsdp", 0) | ns.sharding.shard_dim("dp", 0))
    b = run(str(ns.sharding.fsdp("fsdp", 0) | ns.sharding.shard_dim("dp", 0)))
    assert a["encoder"]["mlp"]["kernel"] == b["encoder"]["mlp"]["kernel"]


def test_unknown_tactic_object():
    with pytest.raises(ns.TacticArgumentError, match="expected a tactic string"):
        run(42)
    with pytest.raises(ns.TacticSyntaxError, match="not valid syntax"):
        run("fsdp(axis='fsdp'")


@pytest.mark.parametrize(
    "strategy, error, fragment",
    [
        ([("(", "replicate")], ns.InvalidRegexError, "rule 0 ('(', 'replicate'): the regex does not compile"),
        ([(".*",)], ns.InvalidStrategyError, "each rule is a (regex, tactic) pair"),
        ("fsdp", ns.InvalidStrategyError, "expected a strategy"),
        ({".*": "replicate"}, ns.InvalidStrategyError, "expected a strategy"),
        ([(3, "replicate")], ns.InvalidStrategyError, "the regex must be a string"),
    ],
)
def test_strategy_errors(strategy, error, fragment):
    with pytest.raises(error) as e:
        ns.infer_sharding(W, strategy, mesh_of("8"))
    assert fragment in str(e.value)
