# Two commands on a fresh machine: `make demo` and `make test` (and `make test-latest`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The newest Python 3.12+ this machine has (pyenv's interpreters, then the PATH).
LATEST_PYTHON ?= $(shell ls -d $$(pyenv root 2>/dev/null)/versions/3.1[2-9]* 2>/dev/null | sort -V | tail -n 1 | sed 's|$$|/bin/python|')
LATEST := .venv-latest
LATEST_STAMP := $(LATEST)/.installed
# Two test processes (pytest-xdist): the many tests that wait on processes they start overlap (the suite's
# time on 2 cores is in benchmarks/RESULTS.md).
TEST_WORKERS ?= 2

.PHONY: demo test test-fast test-slurm slow-list test-latest test-interop interop-install docs lint install bench chaos soak clean

# The oldest supported jax, flax, optax and orbax-checkpoint, pinned (constraints/oldest.txt).
OLDEST := constraints/oldest.txt
STACK = import sys, jax, flax, optax, orbax.checkpoint as o; print('Python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax-checkpoint', o.__version__)

$(STAMP): pyproject.toml $(OLDEST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(OLDEST) -e ".[test,examples,data,tpu,hf]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check nnx_shard tests examples benchmarks docs/_ext docs/conf.py
	$(VENV)/bin/ruff format --check nnx_shard tests examples benchmarks docs/_ext docs/conf.py

test: $(STAMP)
	@$(PY) -c "$(STACK)" | sed 's|^|make test (the oldest supported stack, $(OLDEST)): |'
	$(VENV)/bin/ruff check nnx_shard tests examples benchmarks docs/_ext docs/conf.py
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

# The quick loop while editing: everything but the tests marked slow (processes, long training, compiles).
test-fast: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# Re-time every test the slow modules leave fast and write those over 0.8 s to tests/slow_tests.txt afresh
# (then test-fast leaves them out).
slow-list: $(STAMP)
	@echo "# Tests over 0.8 s (make slow-list regenerates this from a timed run); make test-fast leaves them out." > tests/slow_tests.txt.new
	NNX_SHARD_RETIME=1 JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" --durations=0 | awk '$$1 ~ /s$$/ && $$1+0 > 0.8 {print $$3}' | sed 's/\[.*//' | sort -u >> tests/slow_tests.txt.new
	mv tests/slow_tests.txt.new tests/slow_tests.txt

# The same suite on the newest Python and the newest jax, flax, optax and orbax-checkpoint.
$(LATEST_STAMP): pyproject.toml
	@test -n "$(LATEST_PYTHON)" || (echo "no Python 3.12+ found under pyenv; set LATEST_PYTHON=/path/to/python3.12+" && exit 1)
	test -x $(LATEST)/bin/python || $(LATEST_PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade -e ".[test,examples,data,tpu]" jax jaxlib flax optax orbax-checkpoint
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	@$(LATEST)/bin/python -c "$(STACK)" | sed 's|^|make test-latest (the newest releases): |'
	JAX_PLATFORMS=cpu $(LATEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --durations=15

# The whole round trip against the real thing: torch (its CPU build, Python 3.11), transformers, peft,
# google-tunix and qwix. HF folder -> tunix on fsdp:8 -> qwix LoRA fine-tune -> resume on 4 devices ->
# merged export -> transformers' logits; PEFT export -> PeftModel's logits.
INTEROP := .venv-interop
INTEROP_PYTHON ?= $(shell ls -d $$(pyenv root 2>/dev/null)/versions/3.11* 2>/dev/null | sort -V | tail -n 1 | sed 's|$$|/bin/python|')
INTEROP_STAMP := $(INTEROP)/.installed

$(INTEROP_STAMP): pyproject.toml $(OLDEST)
	test -x $(INTEROP)/bin/python || $(or $(INTEROP_PYTHON),python3.11) -m venv $(INTEROP)
	$(INTEROP)/bin/python -m pip install -q --upgrade pip
	$(INTEROP)/bin/python -m pip install -q -c $(OLDEST) -e ".[test,interop]"
	touch $(INTEROP_STAMP)

interop-install: $(INTEROP_STAMP)

test-interop: $(INTEROP_STAMP)
	@$(INTEROP)/bin/python -c "$(STACK); import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | sed 's|^|make test-interop: |'
	JAX_PLATFORMS=cpu $(INTEROP)/bin/python -m pytest -q -p no:cacheprovider tests/interop

# The SLURM recipe (examples/cluster/slurm.sbatch) run for real: a one-node cluster (munged, slurmctld,
# slurmd; installed with apt where missing) in a temporary folder, tests/slurm against it, every daemon stopped.
test-slurm: $(STAMP)
	PY=$(PY) bash tests/slurm/cluster.sh

# The documentation site: Sphinx, sphinx_book_theme, MyST, autodoc/autosummary/napoleon, intersphinx, a copy
# button; built with warnings as errors, then every page's examples run (sphinx's doctest builder).
DOCS := .venv-docs
DOCS_STAMP := $(DOCS)/.installed

$(DOCS_STAMP): pyproject.toml $(OLDEST)
	test -x $(DOCS)/bin/python || $(PYTHON) -m venv $(DOCS)
	$(DOCS)/bin/python -m pip install -q --upgrade pip
	$(DOCS)/bin/python -m pip install -q -c $(OLDEST) -e ".[docs,tpu]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	cd docs && JAX_PLATFORMS=cpu ../$(DOCS)/bin/sphinx-build -W --keep-going -q -b html . _build/html
	cd docs && JAX_PLATFORMS=cpu ../$(DOCS)/bin/sphinx-build -W --keep-going -q -b doctest . _build/doctest
	@echo "the site: docs/_build/html/index.html"

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) examples/vit/demo.py

BENCHES := create infer init reshard resize resize_hosts restore bucket step guard idioms recovery snapshot load tpu vit suggest

bench: $(STAMP)
	cd benchmarks && for b in $(BENCHES); do JAX_PLATFORMS=cpu ../$(PY) bench_$$b.py --out results/bench_$$b.json || exit 1; done

# A seeded campaign of kills and damaged checkpoints (100 trials, ~20 min on 2 cores); counts go to RESULTS.md.
chaos: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/chaos.py --trials $(or $(TRIALS),100)

# The multi-process snapshot, restart and rollback tests SOAK_RUNS times (30) beside a busy process per core:
# runs, hangs, wrong values and the slowest run of each; the figure goes to RESULTS.md.
soak: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/soak.py --runs $(or $(SOAK_RUNS),30) --out benchmarks/results/soak.json

clean:
	rm -rf $(VENV) $(LATEST) $(INTEROP) build *.egg-info
