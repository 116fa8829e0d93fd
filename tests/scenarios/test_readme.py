"""The README's quickstart and the site's pages run as written."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


CODE = r"```(?:python|\{code-cell\} ipython3)\n(.*?)```"  # a page's blocks, or a notebook page's cells


def section(title: str, text: str = README) -> list[str]:
    text = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(CODE, text, flags=re.S)


def page(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


@pytest.mark.parametrize("where", ["README.md", "getting_started.md"])
def test_quickstart_runs_as_written(where, tmp_path):
    blocks = section("Quickstart", README if where == "README.md" else page(where))
    assert len(blocks) == (3 if where == "README.md" else 5)  # the notebook: devices first, the picture last
    namespace: dict = {}  # nothing given: the blocks define what they use
    picture = blocks.pop() if where != "README.md" else None  # IPython's display: only in a notebook
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # our own README, not user input
    if picture is not None:
        assert 'plan.plot("plan.png", top=4)' in picture
        png = namespace["plan"].plot(str(tmp_path / "plan.png"), top=4)
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # What the README says: ^head/kernel$ also places the optimizer's and the EMA's copies.
    plan, p = namespace["plan"], jax.sharding.PartitionSpec
    for path in ("model/head/kernel", "optimizer/opt_state/0/mu/head/kernel", "ema/params/head/kernel"):
        assert plan.leaf(path).spec == p("fsdp", None), path
    assert plan.leaf("optimizer/opt_state/0/count").spec == p()
    assert plan.leaf("model/body/kernel").spec == p(None, "fsdp") and not any(
        plan.leaf("model/body/bias").spec
    )
    ema = namespace["ema"]
    assert ema.params["head"]["kernel"].get_value().sharding.spec == p("fsdp", None)


def test_newest_idioms_section_runs_as_written(capsys):
    blocks = section("The newest JAX and Flax idioms", page("placement.md"))
    assert len(blocks) == 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # our own README, not user input
    out = capsys.readouterr().out
    assert "ns.sharding.auto_axes" in out.replace("nnx_shard.auto_axes", "ns.sharding.auto_axes")
    assert "item 'default' of a plain Orbax checkpoint onto 4 devices (fsdp=4)" in out
    p = jax.sharding.PartitionSpec
    model, fresh = namespace["model"], namespace["fresh"]
    assert fresh["model"].layers[0].kernel.get_value().sharding.mesh.devices.size == 4
    assert model.layers[0].kernel.get_value().sharding.spec == p(None, "fsdp")
    assert namespace["state"]["layers"][0]["kernel"].get_value().sharding.spec == p(None, "fsdp")
    assert float(namespace["loss"]) > 0


@pytest.fixture
def docs_generator(tmp_path, monkeypatch):
    """The site's generator (docs/_ext), writing its pages into a temporary folder instead of
    docs/_generated."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "_ext"))
    sys.modules.pop("nnx_shard_docs", None)
    import nnx_shard_docs

    monkeypatch.setattr(nnx_shard_docs, "GENERATED", tmp_path)
    return nnx_shard_docs


def test_the_readme_fits_on_two_screens_and_every_link_of_it_and_the_site_resolves(docs_generator):
    assert len(README.splitlines()) <= 160
    # Pages the build generates are not in a clean checkout: generate them, as `make docs` does first.
    docs_generator.error_pages()
    docs_generator.api_page()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for path in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            generated = (
                target.startswith("_generated/")
                and (docs_generator.GENERATED / target.removeprefix("_generated/")).exists()
            )
            if "://" not in target and not generated and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    linked = set(re.findall(r"\(docs/(\w+)\.md\)", README))
    guides = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert guides <= linked, sorted(guides - linked)  # the README leads to every guide


def test_every_public_name_and_error_gets_a_page_of_the_site(docs_generator, tmp_path):
    """The site's generator, run here: an API entry per public name and a page per error class."""
    import nnx_shard as ns

    nnx_shard_docs = docs_generator
    nnx_shard_docs.error_pages()
    nnx_shard_docs.api_page()
    api = (tmp_path / "api.md").read_text()
    public = nnx_shard_docs.public_names()  # the top level's names, and each namespace's others
    assert "sharding.fsdp" in public and "sources.Source" in public and "Trainer" in public
    top = [n for n in ns.__all__ if n not in ns.errors.__all__ and not inspect.ismodule(getattr(ns, n))]
    assert set(top) - {"__version__"} <= set(public)
    assert [n for n in public if f"   {n}\n" not in api] == []
    assert sorted(p.stem for p in (tmp_path / "errors").glob("*.md")) == sorted(ns.errors.__all__)
    assert (
        "`trainer`" not in nnx_shard_docs.config_table()
        and "| `save_every` | `0` |" in nnx_shard_docs.config_table()
    )


def test_finetuning_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tunix")
    blocks = section("Models users bring", page("finetuning.md"))
    assert len(blocks) == 1 and "..." not in blocks[0]
    monkeypatch.chdir(ROOT)
    code = blocks[0].replace("/tmp/ft/", f"{tmp_path}/")
    namespace: dict = {}
    exec(compile(code, "finetuning.md", "exec"), namespace)  # our own page, not user input
    assert "key map Qwen2ForCausalLM (from config.json)" in capsys.readouterr().out
    assert (tmp_path / "merged" / "config.json").is_file() and (
        tmp_path / "peft" / "adapter_config.json"
    ).is_file()


def test_the_finetuning_page_tables_every_family_the_code_carries_and_refuses():
    from nnx_shard._families import TABLE

    text = page("finetuning.md")
    for family, (carried, refused) in TABLE.items():
        assert f"| {family} | {carried} | {refused} |" in text, family


def test_elastic_page_runs_as_written():
    pytest.importorskip("grain")
    blocks = re.findall(r"```python\n(.*?)```", page("elastic.md"), flags=re.S)
    assert len(blocks) == 2 and not any("..." in b for b in blocks)
    namespace: dict = {}
    for block in blocks:  # in order, as a reader runs them: the second uses the first's trainer
        exec(compile(block, "elastic.md", "exec"), namespace)  # our own page, not user input
    assert namespace["trainer"].step == 6 and namespace["trainer"].stop_reason is not None


def test_loading_with_orbax_yourself_runs_as_written(capsys):
    blocks = section("I loaded it with Orbax myself", page("checkpoints.md"))
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "checkpoints.md", "exec"), namespace)  # our own page, not user input
    assert capsys.readouterr().out.splitlines() == [
        "(None, 'fsdp')",
        "restored the loaded state onto 4 devices (fsdp=4)",
        "(None, 'fsdp')",
    ]
    live, model = namespace["live"], namespace["model"]
    assert len(live.kernel.get_value().sharding.device_set) == 4
    assert (live.kernel.get_value() == model.kernel.get_value()).all()


def test_the_trainer_notebook_trains_evaluates_plots_and_restores_as_it_shows(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cells = re.findall(CODE.replace("python|", ""), page("trainer.md"), flags=re.S)
    assert len(cells) == 3
    namespace: dict = {}
    for cell in cells:
        exec(compile(cell, "trainer.md", "exec"), namespace)  # our own page, not user input
    trainer, history = namespace["trainer"], namespace["history"]
    assert (trainer.stop_reason, namespace["seen"], trainer.checkpointer.all_steps()) == (
        "finished",
        [20, 40, 60],
        [40, 60],
    )
    assert [h["step"] for h in history] == [10, 20, 30, 40, 50, 60] and history[-1]["loss"] < history[0][
        "loss"
    ]
    assert [r["step"] for r in namespace["evals"]] == [20, 40, 60]
    assert namespace["model_loss"] < namespace["evals"][-1]["eval_loss"]  # the EMA trails, as the page says
    out = capsys.readouterr().out
    assert "restored step 60, saved on 8 devices (fsdp=8), onto 8 devices (fsdp=8)" in out
    assert "restored step 60 (model only)" in out
    import matplotlib.pyplot as plt

    plt.close("all")


def test_sharding_hooks_by_example_runs_as_written(capsys):
    text = page("trainer.md").split("### ShardingHooks by example\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1 and 'objects["model"].kernel' in blocks[0]
    namespace: dict = {}
    exec(compile(blocks[0], "trainer.md", "exec"), namespace)  # our own page, not user input
    assert capsys.readouterr().out.strip() == "True"
    hooks, objects = namespace["hooks"], namespace["objects"]
    assert objects["model"] is hooks.training_state["model"]
    assert objects["model"].kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
