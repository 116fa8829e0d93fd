"""A jax/flax pair that does not import is named with the fix, whatever exception flax raises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "raised",
    [
        # flax 0.12.8 with jax 0.12
        "AttributeError(\"module 'jax.experimental.hijax' has no attribute 'HiPrimitive'\")",
        "ImportError('cannot import name Foo from jax')",
        "TypeError('unexpected keyword argument')",
    ],
)
def test_a_flax_that_fails_to_import_is_named_with_the_pair_and_the_fix(raised, tmp_path):
    # a flax whose import fails as a mismatched pair's does, ahead of the real one on the path
    (tmp_path / "flax").mkdir()
    (tmp_path / "flax" / "__init__.py").write_text(f"raise {raised}\n")
    done = subprocess.run(
        [sys.executable, "-c", "import nnx_shard"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nnx_shard.errors.IncompatibleVersionsError: flax "), done.stderr[-2000:]
    assert raised.split("(")[0] in last and "pip install -U flax" in last
