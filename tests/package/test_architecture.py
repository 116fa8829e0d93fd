"""The shape of the package: imports point down the layers, no cycles, no private reach-ins, small modules."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import nnx_shard

PACKAGE = Path(nnx_shard.__file__).parent

# The package's folders, bottom to top: a folder never imports one above it (equal ranks may import
# each other, acyclically). Top-level modules sit where they belong: errors and key_maps at the bottom,
# the command line, the seeds' API and the root re-exports at the top.
LAYERS = {
    "_version": 0,
    "errors": 0,
    "_families": 1,  # Hugging Face configs read into tunix's, and tunix's classes with the checkpoint's RoPE
    "key_maps": 1,  # data: the Hugging Face key maps, read by _weights
    "_base": 1,  # specs, paths, meshes, caches, private JAX, bytes and tables
    "_sharding": 2,  # strategy -> plan: tactics, parser, logical, explicit, inference
    "_weights": 2,  # safetensors in and out, key-map transforms, LoRA, PEFT
    "_cluster": 3,  # the distributed runtime, launcher, barriers, TPU topologies
    "_reshard": 3,  # plan_reshard / reshard on plain JAX, with the host route
    "_checkpoint": 4,  # persistent checkpoints: Checkpointer, reads, Orbax, faults, fingerprints, sources
    "_snapshots": 4.5,  # in-memory snapshots: writer, device copy, file format, peer exchange, reader, source
    "_suggest": 4,  # ns.suggest: candidate layouts for a memory budget, planned and costed
    "_live": 5,  # placement, the owner, restore_and_reshard, resize
    "_trainer": 6,
    "cli": 7,
    "__main__": 7,
    "sources": 6,  # the public namespaces: the restore's sources, and the names the top level does not keep
    "sharding": 6,
    "meshes": 6,
    "placement": 6,
    "resharding": 6,
    "cluster": 6,
    "weights": 6,
    "compat": 8,  # the seeds' API, on top of the core and never imported by it
    "__init__": 9,  # the root re-exports everything, the seeds' API included
}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """Each file parsed once for the whole module's tests."""
    return ast.parse(path.read_text())


@functools.cache
def modules() -> dict[str, Path]:
    """Dotted name (relative to the package) -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out[".".join(parts)] = path
    return out


def test_one_meaning_per_module_name_across_the_folders():
    """A private module's name says one thing wherever it sits (``_restore`` was two modules, in two
    layers)."""
    seen: dict[str, list[str]] = {}
    for name in modules():
        if "." in name:
            seen.setdefault(name.rsplit(".", 1)[1], []).append(name)
    assert {n: where for n, where in seen.items() if len(where) > 1} == {}


def layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every nnx_shard import, function-level ones too."""
    out = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnx_shard"):
            out += [
                (node.module.removeprefix("nnx_shard").lstrip("."), a.name, node.lineno) for a in node.names
            ]
        elif isinstance(node, ast.Import):
            out += [
                (a.name.removeprefix("nnx_shard").lstrip("."), None, node.lineno)
                for a in node.names
                if a.name.startswith("nnx_shard")
            ]
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, imported, _ in imports(path):
            full = f"{target}.{imported}" if target and f"{target}.{imported}" in mods else target or imported
            if full in mods and full != name:
                edges[name].add(full)
    return edges


def test_every_import_points_down_the_layers():
    wrong = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph().items()
        for b in targets
        if a and b and layer(b) > layer(a)
    ]
    assert not wrong, "\n".join(wrong)


def folder_of(name: str) -> str | None:
    """The layer folder a module lives in (None for a top-level module)."""
    return name.split(".")[0] if "." in name or (PACKAGE / name).is_dir() else None


def test_a_folder_is_imported_from_outside_only_through_its_face():
    """``from nnx_shard._checkpoint import X`` from another layer; never ``nnx_shard._checkpoint._reads``."""
    bad = []
    for name, path in modules().items():
        for target, imported, line in imports(path):
            top = target.split(".")[0] if target else imported
            if top in LAYERS and (PACKAGE / top).is_dir() and folder_of(name) != top:
                full = f"{target}.{imported}" if target else imported
                if target.count(".") >= 1 or (
                    not target.count(".") and full != top and imported.startswith("_")
                ):
                    bad.append(f"{name} line {line} imports {full} past the face of {top}")
    assert not bad, "\n".join(bad)


def test_every_module_and_folder_opens_with_one_line_saying_what_it_holds():
    missing = []
    for name, path in modules().items():
        doc = ast.get_docstring(parsed(path))
        if not doc or not doc.splitlines()[0].strip():
            missing.append(name or "nnx_shard")
    assert not missing, missing
    assert set(LAYERS) >= {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}


def test_every_attribute_is_set_in_init():
    """A method may change an attribute, never add one: a class's attributes are all in its ``__init__``."""
    bad = []
    for name, path in modules().items():
        for cls in (n for n in ast.walk(parsed(path)) if isinstance(n, ast.ClassDef)):
            methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
            declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | {
                t.id
                for n in cls.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            init = methods.get("__init__") or methods.get("__post_init__")
            in_init = {a for a, _ in _self_assignments(init)} if init else set()
            for method in methods.values():
                if method is not init:
                    bad += [
                        f"{name}:{line} {cls.name}.{method.name} adds self.{a}"
                        for a, line in _self_assignments(method)
                        if a not in in_init | declared | set(methods)
                    ]
    assert not bad, "\n".join(bad)


def _self_assignments(fn: ast.FunctionDef) -> set[tuple[str, int]]:
    out = set()
    for n in ast.walk(fn):
        targets = (
            n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        )
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add((e.attr, n.lineno))
    return out


def test_no_class_is_cut_in_two_through_inheritance():
    """A package class derives from one of ours only when that is an interface (a Protocol, or a base of
    several, as Tactic): never a half-class with one subclass, holding part of its fields and methods."""
    ours: dict[str, tuple[str, list[str]]] = {}
    for name, path in modules().items():
        for cls in (n for n in ast.walk(parsed(path)) if isinstance(n, ast.ClassDef)):
            ours[cls.name] = (name, [ast.unparse(b) for b in cls.bases])
    subclasses = {b: [c for c, (_, bases) in ours.items() if b in bases] for b in ours}
    bad = [
        f"{where}: {cls}({base}), the only subclass of {base}"
        for cls, (where, bases) in ours.items()
        for base in bases
        if base in ours
        and where != "errors"
        and "Protocol" not in ours[base][1]
        and len(subclasses[base]) < 2
    ]
    assert not bad, bad


def test_the_import_graph_has_no_cycle():
    edges, state, cycle = graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                cycle.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])
    assert not cycle, cycle


def test_the_core_never_imports_the_compatibility_layer():
    core = [a for a in graph() if a != "__init__" and not a.startswith("compat")]
    offenders = [f"{a} imports {b}" for a in core for b in graph()[a] if b.startswith("compat")]
    assert not offenders, offenders


def test_no_module_imports_another_modules_private_name():
    mods = modules()
    bad = []
    for path in mods.values():
        for target, imported, line in imports(path):
            if (
                imported
                and imported.startswith("_")
                and not imported.startswith("__")
                and f"{target}.{imported}".lstrip(".") not in mods
            ):
                bad.append(f"{path.name}:{line} imports {imported} from {target}")
        for node in ast.walk(parsed(path)):  # module._name reach-ins
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in {"ns", "nnx_shard", "_collective", "_planner", "_blocks"}
            ):
                bad.append(f"{path.name}:{node.lineno} reaches into {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_private_jax_is_touched_in_one_place():
    users = [
        name
        for name, path in modules().items()
        if "jax._src" in path.read_text() and name != "_base._jax_private"
    ]
    assert not users, users


def test_every_exception_class_lives_in_the_errors_module():
    stray = []
    for info in pkgutil.walk_packages(nnx_shard.__path__, "nnx_shard."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException | Warning)
                and obj.__module__ == info.name
            ):
                if info.name != "nnx_shard.errors":
                    stray.append(f"{info.name}.{obj.__name__}")
    assert not stray, stray


def test_every_error_is_an_nnx_shard_error_of_a_builtin_kind():
    from nnx_shard import errors as _errors

    for obj in vars(_errors).values():
        if (
            inspect.isclass(obj)
            and issubclass(obj, Exception)
            and not issubclass(obj, Warning)
            and obj.__module__ == _errors.__name__
        ):
            assert issubclass(obj, nnx_shard.NnxShardError), obj
            assert obj is nnx_shard.NnxShardError or issubclass(
                obj, ValueError | TypeError | RuntimeError | TimeoutError | ImportError
            ), obj


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= 450, f"{name} has {lines} lines; split it by concept"


def test_public_names_are_exported_and_documented():
    for name in nnx_shard.__all__:
        obj = getattr(nnx_shard, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"{name} has no docstring"


def test_errors_have_a_namespace_and_the_seeds_names_warn_once_from_the_top_level():
    import warnings

    import nnx_shard as ns

    assert ns.errors.CheckpointError is ns.CheckpointError and "CheckpointError" in ns.errors.__all__
    assert all(isinstance(getattr(ns.errors, n), type) for n in ns.errors.__all__)
    assert "AutoShardingRule" not in ns.__all__ and "AutoShardingRule" not in dir(ns)
    ns._warned.discard("create_device_mesh")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ns.create_device_mesh is ns.compat.create_device_mesh
        assert ns.create_device_mesh is ns.compat.create_device_mesh  # once
    assert len(caught) == 1 and issubclass(caught[0].category, DeprecationWarning)
    assert "from nnx_shard.compat import create_device_mesh" in str(caught[0].message)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        ns.no_such_name  # noqa: B018
    assert isinstance(ns.__version__, str)


def test_no_function_body_is_over_60_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant
                ):
                    body = body[1:]  # the docstring does not count
                if body and body[-1].end_lineno - body[0].lineno + 1 > 60:
                    long.append(f"{name}.{node.name}: {body[-1].end_lineno - body[0].lineno + 1} lines")
    assert not long, long


def test_the_trainers_parts_are_given_what_they_need_not_the_trainer(tmp_path):
    """The Trainer is composed: its parts (loop, recovery, checkpoints, ...) are built from the few parts of
    it they use, never from the Trainer itself; no part declares a protocol of the Trainer's members."""
    from tests.apps.trainer_app import RegressionTrainer, config

    found = []
    for name, path in modules().items():
        if not name.startswith("_trainer.") or name in ("_trainer._trainer", "_trainer._views"):
            continue  # the Trainer itself, and its attributes' descriptors (``trainer.model``), which get it
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.arg) and node.arg in ("trainer", "host"):
                found.append(f"{name}: a parameter {node.arg}")
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith("Protocol") for b in node.bases
            ):
                members = [n for n in node.body if isinstance(n, (ast.AnnAssign, ast.FunctionDef))]
                if len(members) > 4:
                    found.append(f"{name}: protocol {node.name} of {len(members)} members")
    assert not found, found
    trainer = RegressionTrainer(config(str(tmp_path)))
    assert trainer.loop.progress is trainer.progress is trainer.checkpoints.progress
    trainer.step = 7  # the Trainer's step is its progress's
    assert trainer.progress.step == 7 and trainer.recovery.progress.step == 7


def test_python_started_next_to_a_checkout_imports_the_package(tmp_path):
    """A checkout folder named nnx_shard in the working directory is not imported as an empty namespace."""
    import subprocess
    import sys

    (tmp_path / "nnx_shard").symlink_to(PACKAGE.parent, target_is_directory=True)
    code = "import nnx_shard as ns; print(ns.__file__, ns.Trainer.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == [str(PACKAGE / "__init__.py"), "Trainer"], out.stdout + out.stderr


def test_tests_are_grouped_like_the_package_and_import_no_benchmark():
    """Tests of a layer sit in its folder, the programs tests start in tests/apps; no test imports
    benchmarks."""
    import re

    tests = PACKAGE.parent / "tests"
    layers = {name.lstrip("_") for name in LAYERS if (PACKAGE / name).is_dir()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert layers <= folders, sorted(layers - folders)
    assert not list(tests.glob("test_*.py")), "a test module outside a folder"
    main = re.compile(r"^if __name__ == .__main__.:", re.MULTILINE)
    programs = [p.name for p in tests.rglob("*.py") if main.search(p.read_text()) and p.parent.name != "apps"]
    assert programs == ["make_tiny.py"], programs  # the test data's generator sits with its data
    issue = re.compile(r"\bissue\s+#?\d+", re.IGNORECASE)
    for path in tests.rglob("*.py"):
        tree = parsed(path)
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "benchmarks"], path
        assert not issue.search(path.read_text()), path


def test_snapshots_are_their_own_layer_above_the_persistent_checkpoints():
    """``_checkpoint`` keeps persistent checkpoints only; the in-memory snapshots are ``_snapshots``, which
    may use it (fingerprints, the sources' registry) and never the other way round."""
    assert not [p.name for p in (PACKAGE / "_checkpoint").glob("*.py") if "snapshot" in p.name]
    assert {p.stem for p in (PACKAGE / "_snapshots").glob("_*.py")} >= {
        "_writer",
        "_device",
        "_file",
        "_peer",
        "_reader",
        "_source",
    }
    assert LAYERS["_checkpoint"] < LAYERS["_snapshots"] < LAYERS["_live"]
