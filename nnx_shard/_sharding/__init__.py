"""From a strategy to a plan: tactics, their parser, logical and explicit axes, inference; nothing
allocated."""

from nnx_shard._sharding._explicit import auto_axes, auto_axes_on, on_mesh
from nnx_shard._sharding._inference import infer_sharding, plan_sharding, quiet_planning
from nnx_shard._sharding._logical import annotated, logical_rules_of, logical_to_mesh
from nnx_shard._sharding._notes import Note, Noted, NoteKind
from nnx_shard._sharding._parser import parse_tactic, register_tactic, unregister_tactic
from nnx_shard._sharding._plan import LeafPlacement, ShardingPlan
from nnx_shard._sharding._tactics import Tactic, fsdp, replicate, shard_dim, spec, stacked, validate_spec

__all__ = [
    "LeafPlacement",
    "Note",
    "NoteKind",
    "Noted",
    "ShardingPlan",
    "Tactic",
    "annotated",
    "auto_axes",
    "auto_axes_on",
    "fsdp",
    "infer_sharding",
    "logical_rules_of",
    "logical_to_mesh",
    "on_mesh",
    "parse_tactic",
    "plan_sharding",
    "quiet_planning",
    "register_tactic",
    "replicate",
    "shard_dim",
    "spec",
    "stacked",
    "unregister_tactic",
    "validate_spec",
]
