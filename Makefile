# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Bytecode is written and reused, even where PYTHONDONTWRITEBYTECODE is set (as on some CI
# machines): otherwise every process, the tests' many CLI subprocesses included, compiles
# the sources it imports anew (4 s to import the CLI with bytecode, 10 s without), and a
# second run cannot reuse pytest's rewritten test modules (~7 s of collection per worker).
RUN := env -u PYTHONDONTWRITEBYTECODE

.PHONY: venv demo test test-jax011 lint bench bench-numerics bench-verdicts clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# uv installs the ~600 MB of dependencies in about 20 s where pip takes about 90 s on a
# fresh 2-core machine (empty caches); pip does it when uv cannot be had or fails. uv
# writes no bytecode: the first import of each module does (see RUN), which costs
# ~8 s once instead of ~30 s for compiling every file at install.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	( $(BIN)/pip install -q uv && \
	  $(BIN)/uv pip install -q --python $(BIN)/python -e ".[dev]" ) || \
	( $(BIN)/pip install -q -U pip && $(BIN)/pip install -q -e ".[dev]" )
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(RUN) $(BIN)/scalescope demo

# Whole test modules to each of the 2 workers (tests of a module share fixtures and
# compiled steps), slowest modules first (tests/conftest.py orders them; --durations
# shows what to reorder).
test: venv
	$(RUN) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=60

# The GPU image's JAX (0.11.2, which needs Python 3.12) on this CPU, in a venv of its own:
# the suite (or TESTS=...) against the JAX a first GPU run meets (docs/gpu.md). With pyenv:
# make test-jax011 PY312=$$(pyenv root)/versions/3.12.1/bin/python  (~35 min on 2 cores)
PY312 ?= python3.12
VENV011 := .venv-jax011
TESTS ?= tests
$(VENV011)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV011)
	$(VENV011)/bin/pip install -q uv && \
	  $(VENV011)/bin/uv pip install -q --python $(VENV011)/bin/python -e ".[dev]" "jax==0.11.2"
	touch $@

test-jax011: $(VENV011)/.installed
	$(RUN) $(VENV011)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
	  -p no:cacheprovider $(TESTS)

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/bench_scalify.py
	$(BIN)/python benchmarks/bench_scale_kernels.py
	$(BIN)/python benchmarks/bench_probe.py
	$(BIN)/python benchmarks/bench_run.py
	$(BIN)/python benchmarks/bench_dashboard.py

# The paper's table (fp32 / fp16 / fp8 / naive fp8 losses on the char GPT): ~30 min on 2 cores.
bench-numerics: venv
	$(BIN)/python benchmarks/bench_numerics.py

# The verdict's labelled corpus (docs/advisor.md): ~25 min on 2 cores.
bench-verdicts: venv
	$(BIN)/python benchmarks/bench_verdicts.py --check

clean:
	rm -rf $(VENV) $(VENV011) build *.egg-info
