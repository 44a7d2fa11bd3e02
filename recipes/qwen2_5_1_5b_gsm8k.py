"""Qwen2.5-1.5B-Instruct on GSM8K with GRPO: the smallest Qwen2.5 that learns the format quickly.

Run:      lowmem-grpo train recipes/qwen2_5_1_5b_gsm8k.py
          python recipes/qwen2_5_1_5b_gsm8k.py train.max_steps=10
Hardware: one 8 GB CUDA GPU (`lowmem-grpo plan recipes/qwen2_5_1_5b_gsm8k.py` prints the breakdown).
Planner:  peak 3.13 GiB with Unsloth (backend auto), 6.29 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 300 steps, completions up to 512 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """Qwen2.5-1.5B-Instruct, 8 GB GPU."""
    return gsm8k_gpu("qwen2.5-1.5b-gsm8k", "Qwen/Qwen2.5-1.5B-Instruct", gpu_memory_gb=8, max_steps=300)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
