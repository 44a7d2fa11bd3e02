"""lowmem_grpo: GRPO reasoning training for small language models on one consumer GPU.

Importing the package is light (no torch, trl or unsloth), so the CLI starts fast and the Unsloth
backend can be imported before trl/transformers/peft.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
