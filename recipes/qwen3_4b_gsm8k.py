"""Qwen3-4B on GSM8K with GRPO: Qwen3 4B with room for long reasoning.

Run:      lowmem-grpo train recipes/qwen3_4b_gsm8k.py
          python recipes/qwen3_4b_gsm8k.py train.max_steps=10
Hardware: one 24 GB CUDA GPU (`lowmem-grpo plan recipes/qwen3_4b_gsm8k.py` prints the breakdown).
Planner:  peak 7.13 GiB with Unsloth (backend auto), 16.39 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 250 steps, completions up to 1024 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """Qwen3-4B, 24 GB GPU."""
    return gsm8k_gpu("qwen3-4b-gsm8k", "Qwen/Qwen3-4B", gpu_memory_gb=24, max_steps=250, max_completion_length=1024)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
