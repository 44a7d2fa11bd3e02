"""lowmem_grpo: GRPO reasoning training for small language models on one consumer GPU. Importing it imports no
torch, trl or unsloth, so the CLI starts fast and Unsloth can come before trl/transformers/peft."""

__version__ = "0.1.0"

DEFAULT_RECIPE = "recipes/smollm2_135m_arith_cpu.py"
"""The CPU default, relative to the repository root: what `make demo` trains (the Makefile names the same file),
what `lowmem-grpo train` without a recipe suggests."""

__all__ = ["DEFAULT_RECIPE", "__version__"]
