"""Qwen2.5-3B-Instruct on GSM8K with GRPO: a stronger Qwen2.5 for a 12 GB card.

Run:      lowmem-grpo train recipes/qwen2_5_3b_gsm8k.py
          python recipes/qwen2_5_3b_gsm8k.py train.max_steps=10
Hardware: one 12 GB CUDA GPU (`lowmem-grpo plan recipes/qwen2_5_3b_gsm8k.py` prints the breakdown).
Planner:  peak 4.42 GiB with Unsloth (backend auto), 9.43 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 250 steps, completions up to 512 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """Qwen2.5-3B-Instruct, 12 GB GPU."""
    return gsm8k_gpu("qwen2.5-3b-gsm8k", "Qwen/Qwen2.5-3B-Instruct", gpu_memory_gb=12, max_steps=250)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
