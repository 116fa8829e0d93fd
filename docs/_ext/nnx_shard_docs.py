"""What the site generates from the code at build time: pictures of each tactic's layout, a page per error
class, the Trainer's config keys, the API pages, offline inventories of the libraries nnx_shard builds on;
and the check that fails the build when a public name has no page."""

from __future__ import annotations

import importlib.util
import inspect
import shutil
import zlib
from pathlib import Path
from typing import Any

import error_examples
import jax

import nnx_shard as ns

HERE = Path(__file__).resolve().parents[1]
GENERATED = HERE / "_generated"
TACTICS = [  # shown on a (8, 16) array over a 2x4 mesh (dp=2, fsdp=4)
    ("replicate", "replicate()"),
    ("fsdp", "fsdp(axis='fsdp', min_size_to_shard_mb=0)"),
    ("fsdp over both axes", "fsdp(axis=('dp', 'fsdp'), min_size_to_shard_mb=0)"),
    ("shard_dim 0 on dp", "shard_dim(axis='dp', dim=0)"),
    ("spec", "spec('dp', 'fsdp')"),
    ("chained with |", "shard_dim(axis='dp', dim=0)|fsdp(axis='fsdp', min_size_to_shard_mb=0)"),
]


def tactic_pictures() -> str:
    """A PNG per tactic (the layout on a 2x4 mesh), and the Markdown that shows them."""
    mesh = ns.create_mesh((2, 4), ("dp", "fsdp"))
    leaf = {"kernel": jax.ShapeDtypeStruct((8, 16), "float32")}
    out = ["| tactic | spec | layout on a 2x4 mesh (one colour per block a device holds) |", "|---|---|---|"]
    for k, (name, tactic) in enumerate(TACTICS):
        plan = ns.plan_sharding(leaf, [(".*", tactic)], mesh)
        path = GENERATED / f"tactic_{k}.png"
        plan.plot(str(path), top=1)
        spec = plan.leaf("kernel").spec
        out.append(f"| {name}: `{tactic}` | `{tuple(spec)}` | ![{name}](_generated/tactic_{k}.png) |")
    return "\n".join(out) + "\n"


def error_pages() -> None:
    """One page per exception and warning class: when it is raised, a sample message, and the fix.

    The sample is what running the class's example in ``error_examples`` raised during this build (or, for
    the few that need several processes or another jax, the message as the source writes it, said so).
    """
    folder = GENERATED / "errors"
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(ns.errors.__all__)
    missing = [n for n in names if n not in error_examples.EXAMPLES and n not in error_examples.BASES]
    if missing:
        raise RuntimeError(
            f"error classes without an example and a fix in docs/_ext/error_examples.py: {missing}"
        )
    for name in names:
        obj = getattr(ns.errors, name)
        kind = "autoexception" if isinstance(obj, type) and issubclass(obj, BaseException) else "autoclass"
        bases = ", ".join(f"`{b.__name__}`" for b in obj.__mro__[1:-1]) if isinstance(obj, type) else ""
        parts = [f"# {name}\n\nDerives from: {bases or '-'}.\n\n## When it is raised\n"]
        parts.append(f"```{{eval-rst}}\n.. {kind}:: nnx_shard.errors.{name}\n   :no-index:\n```\n")
        if name in error_examples.BASES:
            subs = sorted(c.__name__ for c in obj.__subclasses__() if c.__name__ in names)
            parts.append(f"## What to do\n\nA base class: {error_examples.BASES[name]}\n")
            if subs:
                parts.append("Raised as: " + ", ".join(f"[{c}]({c}.md)" for c in subs) + ".\n")
        elif error_examples.EXAMPLES[name].fix:
            text, ran = error_examples.sample(name)
            if text:
                how = "raised by its example while this site was built" if ran else "as the source writes it"
                parts.append(f"## A sample message\n\n({how})\n\n```text\n{text}\n```\n")
            parts.append(f"## The fix\n\n{error_examples.EXAMPLES[name].fix}\n")
        (folder / f"{name}.md").write_text("\n".join(parts))
    toc = "\n".join(f"errors/{n}" for n in names)
    (GENERATED / "errors.md").write_text(
        "# Errors\n\nEvery exception derives from `NnxShardError` and from the builtin that fits its kind, "
        "so "
        "`except ValueError` still catches a bad tactic. One page per class: when it is raised, a sample "
        "message and the fix.\n\n"
        f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n"
    )


def config_table() -> str:
    """Every key of ``Trainer.default_config()`` from its one schema: default, what it expects, what it
    means."""
    from nnx_shard._trainer import _config

    rows = ["| key | default | expects | meaning |", "|---|---|---|---|"]
    for key, k in _config.SCHEMA.items():
        rows.append(f"| `{key}` | `{k.default!r}` | {k.expects} | {k.meaning} |".replace("\n", " "))
    renamed = ", ".join(f"`{old}` (now `{new}`)" for old, new in _config.RENAMED.items())
    return "\n".join(rows) + f"\n\nOld names still read, with a `DeprecationWarning`: {renamed}.\n"


TOPICS: dict[str, tuple[str, list[str]]] = {
    "Sharding": (
        "Rules to shardings: plans, tactics and the leaves they see.",
        [
            "plan_sharding",
            "infer_sharding",
            "ShardingPlan",
            "sharding.LeafPlacement",
            "sharding.Leaf",
            "sharding.parse_tactic",
            "sharding.Tactic",
            "sharding.register_tactic",
            "sharding.unregister_tactic",
            "sharding.replicate",
            "sharding.fsdp",
            "sharding.shard_dim",
            "sharding.spec",
            "sharding.stacked",
            "sharding.annotated",
            "sharding.logical_to_mesh",
            "sharding.auto_axes",
            "sharding.flatten_state",
        ],
    ),
    "Meshes": (
        "Meshes from sizes or strings, described.",
        [
            "create_mesh",
            "meshes.mesh_from_string",
            "meshes.parse_mesh_dims",
            "meshes.describe_mesh",
            "meshes.calculate_host_mesh_shape",
        ],
    ),
    "Placement": (
        "State onto its shardings without a whole array on one device.",
        [
            "place_like_target",
            "placement.abstract_target",
            "create_sharded",
            "placement.sharded_init_fn",
            "clear_caches",
        ],
    ),
    "Resharding": (
        "From one sharding to another, each byte moved once.",
        [
            "reshard",
            "resharding.plan_reshard",
            "resharding.ReshardPlan",
            "resharding.LeafReshard",
            "resharding.Route",
            "resharding.find_intermediate_sharding",
            "ResizeReport",
        ],
    ),
    "Checkpoints": (
        "Save, and restore onto any mesh.",
        [
            "Checkpointer",
            "restore_and_reshard",
            "RestoreOptions",
            "RestoreReport",
            "sources.CheckpointSource",
            "sources.LoadedState",
            "sources.OrbaxSource",
            "sources.ReadRequest",
            "sources.SafetensorsFolder",
            "sources.Snapshots",
            "sources.Source",
            "sources.as_source",
            "sources.register_source",
            "sources.registered",
            "sources.unregister_source",
        ],
    ),
    "Trainer": (
        "The training loop, and the hooks for your own.",
        ["Trainer", "default_config", "ShardingHooks", "TrainingState", "sharding.Kind"],
    ),
    "Weights": (
        "Hugging Face folders in and out.",
        ["load_safetensors", "weights.LoadReport", "save_safetensors", "weights.save_peft_adapters"],
    ),
    "Cluster": (
        "Several processes, TPU topologies, data per process.",
        [
            "cluster.initialize_distributed",
            "barrier_sync",
            "cluster.launch",
            "cluster.launch_info",
            "cluster.LaunchInfo",
            "cluster.host_local_to_global",
            "cluster.data_sharding",
            "cluster.data_shard",
            "cluster.DataShard",
            "cluster.tpu_devices",
            "cluster.CompileReport",
        ],
    ),
    "Suggest": ("Rules for a memory budget, checked by the compiler.", ["suggest", "Suggestion"]),
    "Utilities": ("", ["format_bytes"]),
}


NAMESPACES = ("sharding", "meshes", "placement", "resharding", "cluster", "weights", "sources")


def public_names() -> list[str]:
    """The names of ``nnx_shard`` with an API page: all but the errors (their own pages) and the modules."""
    skip = {*ns.errors.__all__, "compat", "errors", "key_maps", "__version__", *NAMESPACES}
    top = [n for n in ns.__all__ if n not in skip]
    return top + [f"{m}.{n}" for m in NAMESPACES for n in getattr(ns, m).__all__ if n not in ns.__all__]


def api_page() -> None:
    """The API page: every public name of ``nnx_shard``, grouped by topic; a name in no topic fails the
    build."""
    placed = [n for _, names in TOPICS.values() for n in names]
    unplaced = sorted(set(public_names()) - set(placed))
    unknown = sorted(set(placed) - set(public_names()))
    if unplaced or unknown:
        raise RuntimeError(
            f"docs/_ext/nnx_shard_docs.py TOPICS: public names in no topic {unplaced}, "
            f"names that are not public {unknown}"
        )
    sections = []
    for topic, (blurb, names) in TOPICS.items():
        body = "\n".join(f"   {n}" for n in names)
        sections.append(
            f"## {topic}\n\n{blurb}\n\n```{{eval-rst}}\n.. currentmodule:: nnx_shard\n\n"
            f".. autosummary::\n   :toctree: api\n\n{body}\n```\n"
        )
    (GENERATED / "api.md").write_text(
        "# API\n\nEverything `import nnx_shard as ns` gives, by topic; each entry links its source. The "
        "errors "
        "have [their own pages](errors.md), the Hugging Face key maps are `ns.key_maps`, the seeds' API "
        "`ns.compat`.\n\n" + "\n".join(sections)
    )


def inventories() -> None:
    """objects.inv for jax, flax, optax, orbax and numpy from the installed packages (offline fallback)."""
    import flax.nnx
    import numpy
    import optax
    import orbax.checkpoint

    folder = HERE / "_inventories"
    folder.mkdir(exist_ok=True)
    libs = {
        "jax": [(jax, "jax", "_autosummary/{}.html"), (jax.sharding, "jax.sharding", "jax.sharding.html#{}")],
        "flax": [(flax.nnx, "flax.nnx", "api_reference/flax.nnx/index.html#{}")],
        "optax": [(optax, "optax", "api/api.html#{}")],
        "orbax": [(orbax.checkpoint, "orbax.checkpoint", "api_reference/checkpoint.html#{}")],
        "numpy": [(numpy, "numpy", "reference/generated/{}.html")],
    }
    for lib, modules in libs.items():
        lines = []
        for module, prefix, uri in modules:
            for name in dir(module):
                obj = getattr(module, name, None)
                if name.startswith("_") or obj is None or inspect.ismodule(obj):
                    continue
                role = "py:class" if inspect.isclass(obj) else "py:function" if callable(obj) else "py:data"
                full = f"{prefix}.{name}"
                lines.append(f"{full} {role} 1 {uri.format(full)} -")
        head = (
            f"# Sphinx inventory version 2\n# Project: {lib}\n# Version: installed\n"
            "# The remainder of this file is compressed using zlib.\n"
        )
        (folder / f"{lib}.inv").write_bytes(head.encode() + zlib.compress("\n".join(lines).encode() + b"\n"))


def figures() -> None:
    """The performance page's tables, from ``benchmarks/figures.toml`` (the README shows the same CPU
    table)."""
    spec = importlib.util.spec_from_file_location("figures", HERE.parent / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = module.load()
    for machine in record["machines"]:
        (GENERATED / f"figures_{machine}.md").write_text(module.table(machine, record))


def generate(app: Any, config: Any) -> None:
    for stale in ("api", "errors"):  # pages of names that no longer exist would fail the build
        shutil.rmtree(GENERATED / stale, ignore_errors=True)
    GENERATED.mkdir(exist_ok=True)
    figures()
    inventories()
    (GENERATED / "tactics.md").write_text(tactic_pictures())
    (GENERATED / "config.md").write_text(config_table())
    error_pages()
    api_page()


def check_every_public_name_has_a_page(app: Any, exception: Exception | None) -> None:
    """Fails the build when a public name, or an error class, has no page of its own."""
    if exception is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    missing = [n for n in ns.errors.__all__ if not (out / "_generated" / "errors" / f"{n}.html").exists()]
    missing += [
        n for n in public_names() if not (out / "_generated" / "api" / f"nnx_shard.{n}.html").exists()
    ]
    if missing:
        raise RuntimeError(f"public names without a page: {missing}")


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", generate)
    app.connect("build-finished", check_every_public_name_has_a_page)
    return {"parallel_read_safe": True}
