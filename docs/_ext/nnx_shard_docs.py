"""What the site generates from the code at build time: pictures of each tactic's layout, a page per error
class, the Trainer's config keys, the API pages, offline inventories of the libraries nnx_shard builds on;
and the check that fails the build when a public name has no page."""

from __future__ import annotations

import inspect
import io
import tokenize
import zlib
from pathlib import Path
from typing import Any

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
    """One page per exception and warning class: its docstring (when it is raised, what to do)."""
    folder = GENERATED / "errors"
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(ns.errors.__all__)
    for name in names:
        obj = getattr(ns.errors, name)
        kind = "autoexception" if isinstance(obj, type) and issubclass(obj, BaseException) else "autoclass"
        bases = ", ".join(b.__name__ for b in obj.__mro__[1:-1]) if isinstance(obj, type) else ""
        (folder / f"{name}.md").write_text(
            f"# {name}\n\nDerives from: {bases or '-'}.\n\n```{{eval-rst}}\n.. {kind}:: nnx_shard.errors.{name}\n   :no-index:\n```\n"
        )
    toc = "\n".join(f"errors/{n}" for n in names)
    (GENERATED / "errors.md").write_text(
        "# Errors\n\nEvery exception derives from `NnxShardError` and from the builtin that fits its kind, so "
        "`except ValueError` still catches a bad tactic. One page per class: when it is raised and what to do.\n\n"
        f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n"
    )


def config_table() -> str:
    """Every key of ``Trainer.default_config()``: its default, what it expects, and the comment beside it."""
    from nnx_shard._trainer import _config

    source = inspect.getsource(_config)
    comments: dict[str, str] = {}
    pending = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.string.startswith('"') and tok.start[1] == 4:
            pending = tok.string.strip('"')
        elif tok.type == tokenize.COMMENT and pending is not None:
            comments[pending] = tok.string.lstrip("# ")
            pending = None
        elif tok.type == tokenize.NL:
            pending = None
    rules = _config._rules()
    rows = ["| key | default | expects | meaning |", "|---|---|---|---|"]
    for key, value in _config.DEFAULTS.items():
        expects = rules[key][1] if key in rules else ("a mesh string or Mesh" if key == "mesh" else "rules")
        rows.append(f"| `{key}` | `{value!r}` | {expects} | {comments.get(key, '')} |".replace("\n", " "))
    return "\n".join(rows) + "\n"


def public_names() -> list[str]:
    """The names of ``nnx_shard`` with an API page: all but the errors (their own pages) and the modules."""
    skip = {*ns.errors.__all__, "compat", "errors", "key_maps", "__version__"}
    return [n for n in ns.__all__ if n not in skip]


def api_page() -> None:
    """The API page: every public name of ``nnx_shard``, an autosummary entry each."""
    body = "\n".join(f"   {n}" for n in sorted(public_names(), key=str.lower))
    (GENERATED / "api.md").write_text(
        "# API\n\nEverything `import nnx_shard as ns` gives; the errors have [their own pages](errors.md), "
        "the Hugging Face key maps are `ns.key_maps`, the seeds' API `ns.compat`.\n\n"
        f"```{{eval-rst}}\n.. currentmodule:: nnx_shard\n\n.. autosummary::\n   :toctree: api\n\n{body}\n```\n"
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
        head = f"# Sphinx inventory version 2\n# Project: {lib}\n# Version: installed\n# The remainder of this file is compressed using zlib.\n"
        (folder / f"{lib}.inv").write_bytes(head.encode() + zlib.compress("\n".join(lines).encode() + b"\n"))


def generate(app: Any, config: Any) -> None:
    GENERATED.mkdir(exist_ok=True)
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
    missing += [n for n in public_names() if not (out / "_generated" / "api" / f"nnx_shard.{n}.html").exists()]
    if missing:
        raise RuntimeError(f"public names without a page: {missing}")


def setup(app: Any) -> dict[str, Any]:
    app.connect("config-inited", generate)
    app.connect("build-finished", check_every_public_name_has_a_page)
    return {"parallel_read_safe": True}
