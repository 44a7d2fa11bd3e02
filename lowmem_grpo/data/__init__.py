"""GSM8K data: sources (hub, files, embedded sample) and prompt building with the length rule."""

from lowmem_grpo.data.prompts import build_examples, messages_for, render_prompt
from lowmem_grpo.data.sources import embedded_path, load_rows, source_exists

__all__ = ["build_examples", "embedded_path", "load_rows", "messages_for", "render_prompt", "source_exists"]
