"""For each error and warning class: a few lines that raise it for real, and the fix.

The site's error pages run each snippet at build time and show the message it raised, so a sample never
drifts from the code; a snippet that raises another class (or nothing) fails the build. The few classes
that need several processes, a lost device or another jax release to appear have no snippet: their pages
show the message as the source writes it, and say so.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import textwrap
import warnings
from dataclasses import dataclass

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns

MESH = "mesh = ns.create_mesh((8,), ('fsdp',))\n"
LINEAR = "model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))\n"


@dataclass(frozen=True)
class Example:
    fix: str
    code: str = ""  # runs with ns, nnx, jax, np, optax, tempfile in scope; raises (or warns) the class
    template: str = ""  # for classes with no snippet: the message as the source writes it


BASES = {
    "NnxShardError": "the root of every error: `except ns.errors.NnxShardError` catches all of nnx_shard's.",
    "NnxShardWarning": "the root of every warning: `warnings.filterwarnings('error', category=ns.errors."
    "NnxShardWarning)` turns them all into errors.",
    "ShardingError": "bad input to sharding; raised as one of its subclasses.",
    "TacticError": (
        "a tactic's complaint about one leaf; raised as one of its subclasses, the rule named first."
    ),
    "CheckpointError": (
        "raised as one of its subclasses; the live state and the checkpoints are left as they were."
    ),
    "NoIntermediateShardingError": (
        "raised as such when no intermediate sharding helps; see also its subclass."
    ),
}

EXAMPLES: dict[str, Example] = {
    "UnusedRuleWarning": Example(
        "Fix the rule's regex (paths are `/`-joined, e.g. `model/layers/0/kernel`), or delete the rule.",
        MESH
        + LINEAR
        + "ns.plan_sharding(nnx.state(model), [('.*kernal.*', 'replicate'), ('.*', 'replicate')], mesh)",
    ),
    "CheckpointWarning": Example(
        "Nothing to do unless it repeats: the message says which step was skipped or set aside, and why.",
        "ckpt = ns.Checkpointer(tempfile.mkdtemp(), async_save=False)\n"
        + MESH
        + LINEAR
        + "ckpt.save(1, {'model': model}, mesh=mesh)\nckpt.save(1, {'model': model}, mesh=mesh)",
    ),
    "DataPositionWarning": Example(
        "Pass `grain.experimental.ElasticIterator`, an iterator with `elastic = True`, or a `step -> batch` "
        "callable, so that a run resumed on another process count reads each example once.",
        template=(
            "the {iterator} iterator is elastic but cannot be moved onto data shard {index} of {count}: it "
            "has no reshard(shard_index, shard_count) method, so its batches keep the rows of the shard it "
            "was made for. Give it one, or read with grain.experimental.ElasticIterator."
        ),
    ),
    "MeshError": Example(
        "Ask for as many devices as there are (`jax.device_count()`), or leave one axis as -1 to take the "
        "rest.",
        "ns.create_mesh((16,), ('fsdp',))",
    ),
    "UnknownTacticError": Example(
        "Use a built-in tactic (`replicate`, `fsdp`, `shard_dim`, `spec`, `stacked`, `annotated`) or "
        "register "
        "yours with `ns.sharding.register_tactic`.",
        "ns.sharding.parse_tactic('shard_everything()')",
    ),
    "TacticSyntaxError": Example(
        "Write the tactic as calls with literal arguments, chained with `|`: `fsdp(axis='fsdp')`.",
        "ns.sharding.parse_tactic(\"fsdp(axis='fsdp'\")",
    ),
    "TacticArgumentError": Example(
        "Use the tactic's own argument names (its API page lists them).",
        "ns.sharding.parse_tactic('fsdp(axes=\"fsdp\")')",
    ),
    "MeshAxisError": Example(
        "Name an axis the mesh has (the message lists them), or build the mesh with that axis.",
        MESH + LINEAR + "ns.plan_sharding(nnx.state(model), [('.*', \"fsdp(axis='tp')\")], mesh)",
    ),
    "IndivisibleShardingError": Example(
        "Shard another dimension, a smaller axis, or pad the dimension to a multiple of the axis size.",
        MESH + "model = nnx.Linear(12, 6, rngs=nnx.Rngs(0))\n"
        "ns.plan_sharding(nnx.state(model), [('.*kernel', \"shard_dim(axis='fsdp', dim=0)\"), ('.*', "
        "'replicate')], mesh)",
    ),
    "ShardingConflictError": Example(
        "Chain tactics that use different mesh axes, or keep one of them.",
        "mesh = ns.create_mesh((2, 4), ('dp', 'fsdp'))\n"
        + LINEAR
        + "ns.plan_sharding(nnx.state(model), [('.*kernel', \"shard_dim(axis='fsdp', dim=0)|"
        "shard_dim(axis='fsdp', dim=1)\"), ('.*', 'replicate')], mesh)",
    ),
    "InvalidStrategyError": Example(
        "Pass an ordered list of `(regex, tactic)` pairs.",
        MESH + LINEAR + "ns.plan_sharding(nnx.state(model), {'.*': 'replicate'}, mesh)",
    ),
    "InvalidRegexError": Example(
        "Fix the regex (Python's `re` syntax); the message shows where it fails.",
        MESH + LINEAR + "ns.plan_sharding(nnx.state(model), [('(kernel', 'replicate')], mesh)",
    ),
    "UnmatchedLeavesError": Example(
        "End the strategy with a catch-all rule such as `('.*', 'replicate')`, or drop `strict=True`.",
        MESH + LINEAR + "ns.plan_sharding(nnx.state(model), [('.*kernel', 'replicate')], mesh, strict=True)",
    ),
    "PlacementError": Example(
        "Give a tree with the target's structure and shapes, each divisible by the mesh axes sharding it "
        "(the "
        "message names the first leaf that does not fit).",
        MESH + "ns.place_like_target({'w': np.zeros((3, 4))}, {'w': jax.NamedSharding(mesh, jax.P('fsdp'))})",
    ),
    "LocalSliceError": Example(
        "Give each process the slice of the global array its devices hold (the message gives the shape).",
        template=(
            "local slice of shape {shape} cannot be split over this process's {n} devices: its first "
            "dimension must be a multiple of {n}."
        ),
    ),
    "ReshardError": Example(
        "Pass arrays that lie on the `in_sharding` the plan was made for, and targets of the same shapes.",
        template="an input array is on {sharding}, not on in_sharding {in_sharding}.",
    ),
    "NoIntermediateShardingNeededError": Example(
        "Copy the shards directly: `ns.reshard` does so without an intermediate.",
        "mesh = ns.create_mesh((8,), ('fsdp',))\n"
        "src = jax.sharding.NamedSharding(mesh, jax.P('fsdp'))\n"
        "ns.resharding.find_intermediate_sharding(src, src, (64,))",
    ),
    "NoCheckpointError": Example(
        "Point at the directory that holds the step folders (a Trainer's workdir works), or train first; the "
        "message names any checkpoint folder found below the path.",
        MESH
        + LINEAR
        + "ns.restore_and_reshard(tempfile.mkdtemp(), {'model': model}, [('.*', 'replicate')], mesh)",
    ),
    "CheckpointMismatchError": Example(
        "Restore into objects built like the ones saved (the message names the first leaf that differs), or "
        "pass only the items that match.",
        "d = tempfile.mkdtemp()\n"
        + MESH
        + "ns.Checkpointer(d, async_save=False).save(1, {'model': nnx.Linear(16, 32, rngs=nnx.Rngs(0))}, "
        "mesh=mesh)\n"
        "ns.restore_and_reshard(d, {'model': nnx.Linear(16, 8, rngs=nnx.Rngs(0))}, [('.*', 'replicate')], "
        "mesh)",
    ),
    "CheckpointFormatError": Example(
        "Point at a checkpoint nnx_shard or Orbax wrote; for a plain Orbax checkpoint with several items, "
        "name the one to read.",
        "import pathlib\nd = pathlib.Path(tempfile.mkdtemp())\n(d / '1').mkdir()\n(d / '1' / "
        "'notes.txt').write_text('x')\n"
        + MESH
        + LINEAR
        + "ns.restore_and_reshard(d, {'model': model}, [('.*', 'replicate')], mesh)",
    ),
    "CheckpointCorruptError": Example(
        "Restore an earlier step (`step=`), or let the Trainer fall back to the newest step that verifies.",
        "import pathlib\nd = tempfile.mkdtemp()\n"
        + MESH
        + LINEAR
        + "ns.Checkpointer(d, async_save=False).save(1, {'model': model}, mesh=mesh)\n"
        "for f in pathlib.Path(d).rglob('*'):\n"
        "    if f.is_file() and f.stat().st_size > 100 and 'ocdbt' in str(f) and 'd/' in str(f):\n"
        "        f.write_bytes(b'\\0' * f.stat().st_size)\n"
        "ns.restore_and_reshard(d, {'model': nnx.Linear(16, 32, rngs=nnx.Rngs(1))}, [('.*', 'replicate')], "
        "mesh)",
    ),
    "CheckpointExistsError": Example(
        "Resume the run (`resume=True` / `--resume-auto`), or give the new run its own workdir.",
        template=(
            "workdir {workdir} already holds checkpoints of another run (steps {steps}), and this run does "
            "not resume from them. Resume with config resume='auto' (or call restore_and_reshard), use "
            "another workdir, or set config overwrite=True to set them aside (moved, not deleted) and start "
            "afresh. Nothing in the workdir was touched."
        ),
    ),
    "CheckpointSaveError": Example(
        "Free disk space or fix the directory's permissions; earlier steps are intact and the run can "
        "resume.",
        template=(
            "step {step} could not be written to {directory} ({reason}). The earlier steps are intact; free "
            "space or fix the directory's permissions, and the next save writes."
        ),
    ),
    "NoLayoutFitsError": Example(
        "Raise the budget, add devices, or let `ns.suggest` shard more (the message names the smallest bytes "
        "any layout reached).",
        MESH + LINEAR + "ns.suggest(nnx.state(model), mesh, 64)",
    ),
    "ConflictingArgumentsError": Example(
        "Give `options=` or the keywords it holds, not both.",
        "ns.RestoreOptions.given(ns.RestoreOptions(), free_live=True)",
    ),
    "ConfigError": Example(
        "Give the key a value of the kind the message names.",
        "class T(ns.Trainer):\n    pass\nT({'log_every': -1})",
    ),
    "UnknownConfigKeyError": Example(
        "Fix the key's spelling (the message suggests the nearest key), or declare it in your subclass's "
        "`default_config()`.",
        "class T(ns.Trainer):\n    pass\nT({'batch_sise': 8})",
    ),
    "WeightsMismatchError": Example(
        "Pick the key map of the checkpoint's family, or add rules for the tensors named.",
        "import os, safetensors.numpy\n"
        "f = os.path.join(tempfile.mkdtemp(), 'model.safetensors')\n"
        "safetensors.numpy.save_file({'lm_head.weight': np.zeros((4, 4), np.float32)}, f)\n"
        "ns.load_safetensors(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), f)",
    ),
    "UnsupportedConfigError": Example(
        "Use a model class that computes the field (the fine-tuning guide's family table), or a checkpoint "
        "without it.",
        template=(
            "{arch}: config.json's {field}={value!r} changes the forward pass, and {need}. Nothing was read; "
            "loading anyway would give logits unlike transformers'."
        ),
    ),
    "TopologyError": Example(
        "Name a topology libtpu knows (`v5e:2x4`, `v4:2x2x2`), or install `jax[tpu]`.",
        "ns.cluster.tpu_devices('v9z:2x2')",
    ),
    "CompileError": Example(
        "Read XLA's message it carries; a program that does not fit raises `NoLayoutFitsError` instead.",
        template="XLA could not compile the program for {n} x {device_kind}: {XLA's first line}",
    ),
    "BatchStructureError": Example(
        "Give batches of the structure, shapes and dtypes of the first one (the message names the leaf).",
        template=(
            "the batch's structure changed between steps: it was {before}, now {after}. Give every batch the "
            "same keys and nesting (shapes may change: the step recompiles)."
        ),
    ),
    "CLIError": Example(
        "Fix the command line as the message says; `nnx-shard --help` lists the commands.",
        template="config file {path!r} does not exist.",
    ),
    "EmptyStateKind": Example("Read `EmptyStateError.kind` to tell the cases apart."),
    "EmptyStateError": Example(
        "Wrap arrays in `nnx.Param` (or another Variable), or widen the `wrt` filter; `kind` says which "
        "case.",
        "class Empty(nnx.Module):\n    pass\n"
        + MESH
        + "ns.plan_sharding(Empty(), [('.*', 'replicate')], mesh)",
    ),
    "MissingExtraError": Example(
        "Install the extra the message names, e.g. `pip install 'nnx_shard[plot]'`.",
        template="plan.plot draws with matplotlib, which is not installed: pip install 'nnx-shard[plot]'.",
    ),
    "IncompatibleVersionsError": Example(
        "Install a jax/flax pair the message names (pip allows pairs that do not import together).",
        template=(
            "flax {flax} does not import with jax {jax} (jaxlib {jaxlib}): AttributeError: module "
            "'jax.experimental.hijax' has no attribute 'HiPrimitive'. Install a pair that imports: `pip "
            "install -U flax` (flax >= 0.12.12 with jax 0.12), or `pip install 'jax<0.12' 'jaxlib<0.12'` for "
            "an older flax."
        ),
    ),
    "StateTypeError": Example(
        "Pass the state (`nnx.state(model)`, or `nnx.eval_shape(factory)` for an abstract one), not the "
        "factory.",
        MESH + "ns.plan_sharding(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), [('.*', 'replicate')], mesh)",
    ),
    "LifecycleError": Example(
        "Call `on_init` with the live objects before restoring or saving through the hooks.",
        MESH + "ns.ShardingHooks([('.*', 'replicate')], mesh).restore_and_reshard(tempfile.mkdtemp())",
    ),
    "DistributedNotInitializedError": Example(
        "Call `jax.distributed.initialize()` (or run under `nnx-shard launch`) before the first JAX call.",
        template=(
            "{n} processes but no distributed client; call jax.distributed.initialize(...) in every process "
            "before barrier_sync."
        ),
    ),
    "WorkdirLockedError": Example(
        "Wait for the other job to finish or stop it; the message names its host and process id. A lock left "
        "by a dead process is taken over on its own.",
        template=(
            "workdir {workdir} is in use by another job: host {host}, pid {pid}, started {started} (lock "
            "file {lock}, heartbeat {age} s ago). Wait for it to end, use another workdir, or delete the "
            "lock file if that job is certainly gone."
        ),
    ),
    "StorageError": Example(
        "Use a local folder or a `gs://` bucket that exists; for `gs://`, install the `gcs` extra (gcsfs).",
        "ns.Checkpointer('ftpx://bucket/run')",
    ),
    "CollectiveMismatchError": Example(
        "Find the decision one process took alone (the message names each process's site and step; the "
        "flight record lists their last collectives): every collective must follow from agreed values.",
        template=(
            "the processes were at different collectives when they gathered at 'snapshot.agree': process 0: "
            "'snapshot.agree' (collective #{k}, step 10); process 1: 'snapshot.agree' (collective #{k}, "
            "step 5). They parted at or before collective #{k}: one process issued a collective the others "
            "did not (a decision taken from its own view). This process's last collectives are in {path}."
        ),
    ),
    "StandbyError": Example(
        "Read what the training processes raised (the message carries it); restart the job.",
        template=(
            "process {p} is on standby (it holds no device of the mesh) and lost the processes training: "
            "waiting for message {k} of resize {g}, JAX's coordination service answered {error}"
        ),
    ),
    "BarrierTimeoutError": Example(
        "Find why the missing processes are late (the message lists them); raise `timeout_s` if they are "
        "slow.",
        template=(
            "barrier {name!r} (id {id}) timed out after {timeout} s in process {p} of {n}; missing: 1 "
            "(waiting at 'save/300'), 3 (not at any barrier) ..."
        ),
    ),
}


def sample(name: str) -> tuple[str, bool]:
    """The message ``name`` gives: (text, True) from running its snippet, (template, False) without one.

    Raises:
        RuntimeError: the snippet raised another class, or nothing.
    """
    cls = getattr(ns.errors, name)
    example = EXAMPLES[name]
    if not example.code:
        return example.template, False
    scope = {"ns": ns, "nnx": nnx, "jax": jax, "np": np, "optax": optax, "tempfile": tempfile}
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("always")
        try:
            exec(compile(textwrap.dedent(example.code), f"<{name} example>", "exec"), scope)
        except cls as e:
            if type(e) is cls:
                return str(e), True
            raise RuntimeError(f"the {name} example raised {type(e).__name__}: {e}") from e
    found = [w for w in caught if w.category is cls]
    if found:
        return str(found[0].message), True
    raise RuntimeError(f"the {name} example raised nothing (warnings: {[w.category for w in caught]})")
