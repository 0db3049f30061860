# Everything the project needs, from a fresh clone: `make train`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
RUST_SRC := $(wildcard rust_loader/*.rs) Cargo.toml pyproject.toml

.DEFAULT_GOAL := help
.PHONY: help setup build train test test-fast test-rust test-python bench bench-python lint fmt wheel clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-13s %s\n", $$1, $$2}'

# GPU extras, where an NVIDIA GPU is found: FlashAttention-4 (the fa4 extra) where it runs,
# Hopper or Blackwell (compute capability 9.x or 10.x): the presets' attention=auto then
# takes it for document masking (the GPT-2 preset: 6% more tokens/s on an H100 than
# FlexAttention); nvmath-python (the cublaslt extra) on any NVIDIA GPU: the GPT-2 preset's
# fused_gelu=auto runs the MLP's GELU inside its matmuls (BENCHMARKS.md). FA4=0/1 and
# CUBLASLT=0/1 override. Where they do not install (no wheel for this Python or platform),
# set-up goes on without them and says so.
GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)
FA4 ?= $(if $(filter 9.% 10.%,$(GPU_CC)),1,0)
CUBLASLT ?= $(if $(GPU_CC),1,0)
comma := ,
GPU_EXTRAS := $(if $(filter 1,$(FA4)),$(comma)fa4)$(if $(filter 1,$(CUBLASLT)),$(comma)cublaslt)
EXTRAS := dev$(GPU_EXTRAS)

# The package and its extras (dev pulls in parquet, zstd, plot, hf, ft: torchft, wandb and
# mlflow) through maturin, which builds the extension and has uv install the dependencies
# pyproject.toml lists: uv takes a third of pip's time for torch and the rest (about 40 s against 110 s on
# 2 cores). Compiled to bytecode as they install, as pip does: where PYTHONDONTWRITEBYTECODE
# is set, Python never writes .pyc files, and each process would compile torch's modules
# again. pytrain's own modules too (installed editable, so compiled by no installer): 0.2
# CPU-seconds a process, in each of the few hundred that the tests start; a module edited
# since is compiled again as it is imported.
export UV_COMPILE_BYTECODE := 1
$(VENV)/.ext: $(RUST_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'maturin>=1.7,<2' uv
	$(VENV)/bin/maturin develop --uv --release -q --extras $(EXTRAS) $(if $(GPU_EXTRAS),|| { \
	  echo "note: the GPU extras ($(GPU_EXTRAS:,%=%)) did not install; the presets run without them" >&2; \
	  $(VENV)/bin/maturin develop --uv --release -q --extras dev; })
	$(PY) -m compileall -q pytrain
	touch $@

setup: $(VENV)/.ext ## create .venv, install Python deps (torch included), build the extension

build: setup ## (re)build the Rust extension into .venv

train: setup ## train the embedded default (CPU or GPU, offline, a few minutes)
	$(PY) -m pytrain.train

# The Rust tests build (and run) while set-up installs the Python side and builds the
# extension: the two builds are of different profiles (target/debug, target/release), and
# each alone leaves a core idle at times.
test: ## every test: cargo tests + pytest (slow ones included)
	$(MAKE) --no-print-directory -j2 --output-sync=target setup test-rust
	$(MAKE) --no-print-directory test-python

# cargo's test profile (Cargo.toml), not --release: the Rust tests take seconds unoptimized.
# The core's default features: no PyO3, no S3 (its AWS stack is built by `make setup`, and
# tested through the extension by tests/test_s3.py against a local S3 server).
# MAKEFLAGS cleared: under `make test`'s -j2 it names a jobserver that this recipe does not
# get, and rustdoc warns that it cannot connect to it.
test-rust:
	MAKEFLAGS= cargo test -q

# In parallel (pytest-xdist): two workers more than the cores, as some tests wait on
# processes they started (torchrun's rendezvous, a rank's timeout, a kill and a restart);
# on 2 cores, 4 workers took 619 s, 3 took 667 and 5 664 (BENCHMARKS.md). Tests are handed
# out one at a time in the order collected, the slow first (tests/conftest.py), so that
# short ones fill the workers' ends.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print((os.cpu_count() or 1) + 2)')
PYTEST = $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist load --maxschedchunk 1
test-python: setup
	$(PYTEST) tests

test-fast: setup ## the edit loop: the tests not marked slow, in parallel (under 2 minutes)
	$(PYTEST) -m "not slow" tests

bench: setup ## criterion benches + pack-shards and loader benchmarks (print figures)
	cargo bench --bench loader
	$(PY) benchmarks/pack.py
	$(PY) benchmarks/loader.py

lint: setup ## cargo fmt --check, clippy -D warnings, ruff, mypy, stubtest of the extension
	cargo fmt --check
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check pytrain tests scripts benchmarks
	$(VENV)/bin/ruff format --check pytrain tests scripts benchmarks
	$(PY) -m mypy
	$(PY) -m mypy.stubtest pytrain._loader
	$(PY) -m pytest -q tests/test_structure.py  # import cycles, trainer size, machine paths

fmt: setup ## format Rust and Python
	cargo fmt
	$(VENV)/bin/ruff format pytrain tests scripts benchmarks

wheel: ## abi3 wheel into dist/ (one wheel for CPython 3.10+)
	$(VENV)/bin/maturin build --release -o dist

clean: ## remove build outputs (keeps .venv)
	cargo clean
	rm -rf dist $(VENV)/.ext
