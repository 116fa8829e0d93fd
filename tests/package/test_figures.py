"""The figures the README and the site cite come from one record, each tied to its run in RESULTS.md."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_shows_the_figures_of_the_record_and_nothing_else():
    figures = _figures()
    readme = (ROOT / "README.md").read_text()
    assert figures.readme_block() in readme, (
        "README.md's figures differ from benchmarks/figures.toml: run python benchmarks/figures.py --write"
    )
    outside = readme.replace(figures.readme_block(), "")
    assert not re.search(r"\d\.\d+x the (time|step)", outside), "a figure written by hand outside the table"


def test_each_figure_names_its_date_its_machine_a_command_that_exists_and_a_run_of_that_date():
    record = _figures().load()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    headings = set(re.findall(r"^#+ .*$", results, flags=re.M))
    makefile = (ROOT / "Makefile").read_text()
    assert len(record["figure"]) >= 15
    for f in record["figure"]:
        assert f["machine"] in record["machines"], f
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", f["date"]), f
        assert f["record"] in headings, f"{f['question']}: no section {f['record']!r} in RESULTS.md"
        assert f["date"] in f["record"], f"{f['question']}: dated {f['date']}, its record {f['record']!r}"
        words = shlex.split(f["command"])
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, flags=re.M), f
        else:
            assert words[0] == "python" and (ROOT / words[1]).is_file(), f


def test_the_performance_page_includes_the_generated_tables_and_no_table_of_its_own():
    page = (ROOT / "docs" / "performance.md").read_text()
    machines = _figures().load()["machines"]
    for machine in machines:
        assert f"_generated/figures_{machine}.md" in page
    assert "| question |" not in page
