# The README's two commands are the contract: `make serve` and `make test`, both from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.v4flash-installed
TRITON_STAMP := .triton/.ready

.PHONY: test test-fast serve venv triton golden clean

# Python environment: CPU torch 2.13.0 (pip takes the local file where the machine has it), the
# package in editable mode, test tools.
$(STAMP): pyproject.toml requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . -r requirements-test.txt
	touch $@

venv: $(STAMP)

# tritonserver 2.51 (nvidia-pytriton wheel), tritonclient + perf_analyzer, libb64-0d, backend dir.
$(TRITON_STAMP): $(STAMP) scripts/setup_triton.sh
	bash scripts/setup_triton.sh
	mkdir -p .triton && touch $@

triton: $(TRITON_STAMP)

# tritonserver on 127.0.0.1 (HTTP_PORT 8000, GRPC_PORT 8001, METRICS_PORT 8002) with model_repository/,
# and beside it the OpenAI-compatible API (OPENAI_PORT 9000; scripts/serve_openai.sh)
serve:
	bash scripts/serve.sh

# Tests run in TEST_WORKERS processes (pytest-xdist; a file stays on one worker, so its module
# fixtures are built once), then the `serial` ones alone: each test uses one intra-op thread, so two
# workers keep CI's two cores busy (the suite in ~15 min instead of ~23).
TEST_WORKERS ?= 2

# The third phase runs the numerics-sensitive tests again under a second GEMM summation order (MKL's
# AVX2 path where that changes MKL's kernels, as on Intel CPUs, else a split-K order), after checking
# that the order really changed (checks/gemm_probe.py --second-order prints it), so that the suite
# holds on more than the one BLAS code path of the machine it runs on.
GOLDEN := ../shared/golden/v41-tiny

test: $(STAMP) $(TRITON_STAMP)
	$(PY) -m pytest -q -ra --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial"
	$(PY) -m pytest -q -ra --durations=5 -m serial
	order=$$($(PY) -m v4flash_backend.checks.gemm_probe $(GOLDEN) --second-order) && \
	  echo "[make test] the numerics tests again under the second GEMM order: $$order" && \
	  env $$order $(PY) -m pytest -q -ra --durations=5 -n $(TEST_WORKERS) --dist loadfile -m "numerics and not slow"

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile -m "not slow"

golden: $(STAMP)
	$(PY) -m v4flash_backend golden-check $(GOLDEN)

clean:
	rm -rf $(VENV) .triton .pytest_cache
