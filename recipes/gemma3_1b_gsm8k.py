"""gemma-3-1b-it on GSM8K with GRPO: Gemma 3 1B (gated on the hub: accept its license and set HF_TOKEN).

Run:      lowmem-grpo train recipes/gemma3_1b_gsm8k.py
          python recipes/gemma3_1b_gsm8k.py train.max_steps=10
Hardware: one 8 GB CUDA GPU (`lowmem-grpo plan recipes/gemma3_1b_gsm8k.py` prints the breakdown).
Planner:  peak 2.73 GiB with Unsloth (backend auto), 5.28 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 400 steps, completions up to 512 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """gemma-3-1b-it, 8 GB GPU."""
    return gsm8k_gpu("gemma3-1b-gsm8k", "google/gemma-3-1b-it", gpu_memory_gb=8, max_steps=400)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
