"""GSM8K-style data: sources (hub, files, embedded sample), prompts with the length rule, the target format."""

from lowmem_grpo.data.prompts import build_examples, grpo_examples, recipe_examples, render_prompt
from lowmem_grpo.data.sources import embedded_path, load_eval_rows, load_rows, load_train_rows, source_exists
