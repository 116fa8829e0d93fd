# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check nnx_shard tests examples benchmarks
	$(VENV)/bin/ruff format --check nnx_shard tests examples benchmarks

test: $(STAMP)
	$(VENV)/bin/ruff check nnx_shard tests examples benchmarks
	XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
		$(PY) -m pytest -q

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) examples/vit/demo.py

BENCHES := infer init reshard restore step vit

bench: $(STAMP)
	cd benchmarks && for b in $(BENCHES); do JAX_PLATFORMS=cpu ../$(PY) bench_$$b.py --out results/bench_$$b.json || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
