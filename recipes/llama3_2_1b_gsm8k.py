"""Llama-3.2-1B-Instruct on GSM8K with GRPO: Llama 3.2 1B (gated on the hub: accept its license and set HF_TOKEN).

Run:      lowmem-grpo train recipes/llama3_2_1b_gsm8k.py
          python recipes/llama3_2_1b_gsm8k.py train.max_steps=10
Hardware: one 8 GB CUDA GPU (`lowmem-grpo plan recipes/llama3_2_1b_gsm8k.py` prints the breakdown).
Planner:  peak 3.14 GiB with Unsloth (backend auto), 5.93 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 400 steps, completions up to 512 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """Llama-3.2-1B-Instruct, 8 GB GPU."""
    return gsm8k_gpu("llama3.2-1b-gsm8k", "meta-llama/Llama-3.2-1B-Instruct", gpu_memory_gb=8, max_steps=400)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
