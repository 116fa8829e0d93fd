"""Sphinx configuration of the nnx_shard site: `make docs` builds it with warnings as errors."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)  # every page runs on a laptop CPU with 8 simulated devices

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

import nnx_shard  # noqa: E402

project = "nnx_shard"
author = "the nnx_shard authors"
copyright = "2026, the nnx_shard authors"
release = nnx_shard.__version__

extensions = [
    "myst_nb",  # MyST Markdown (myst_parser) and pages that are notebooks, executed at build time
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",  # a [source] link beside every API entry, to the highlighted module
    "sphinx_copybutton",
    "nnx_shard_docs",
]
myst_enable_extensions = ["colon_fence"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}  # .rst first: autosummary writes .rst
# The guides that are notebooks (front matter `file_format: mystnb`) run on every build, on the CPU with 8
# simulated devices; a cell that raises fails the build. The doctest builder reuses the html build's run.
nb_execution_mode = "cache"
nb_execution_cache_path = str(Path(__file__).parent / "_build" / "jupyter_cache")
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_execution_in_temp = True  # files a cell writes (plan.png) land in a temporary folder, not in docs/
nb_merge_streams = True
exclude_patterns = [
    "_build",
    "_inventories",
    "_generated/tactics.md",
    "_generated/config.md",
    "_generated/figures_*.md",
]
autosummary_generate = True
autodoc_typehints = "description"  # type hints shown with each parameter
# ...with the parameters the docstring documents only: a dataclass's fields are its Attributes, listed once.
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
html_theme = "sphinx_book_theme"
html_title = f"nnx_shard {release}"
html_theme_options = {"show_toc_level": 2}
html_static_path: list[str] = []
suppress_warnings = ["myst.header"]  # pages moved from the README start below level one in places

# The libraries nnx_shard builds on. Their sites first; offline, inventories made from the installed
# packages (docs/_ext/nnx_shard_docs.py writes them) so the build still links and never warns.
INVENTORIES = HERE / "_inventories"
intersphinx_mapping = {
    name: (url, (None, str(INVENTORIES / f"{name}.inv")))
    for name, url in {
        "jax": "https://docs.jax.dev/en/latest/",
        "flax": "https://flax.readthedocs.io/en/latest/",
        "optax": "https://optax.readthedocs.io/en/latest/",
        "orbax": "https://orbax.readthedocs.io/en/latest/",
        "numpy": "https://numpy.org/doc/stable/",
    }.items()
}
intersphinx_timeout = 3

doctest_default_flags = __import__("doctest").ELLIPSIS | __import__("doctest").NORMALIZE_WHITESPACE
doctest_global_setup = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import nnx_shard as ns
"""
# The pages' own {doctest} blocks run here; the docstrings' examples run under pytest --doctest-modules.
doctest_test_doctest_blocks = ""
