"""Llama-3.2-3B-Instruct on GSM8K with GRPO: Llama 3.2 3B with longer completions (gated on the hub:
accept its license and set HF_TOKEN).

Run:      lowmem-grpo train recipes/llama3_2_3b_gsm8k.py
          python recipes/llama3_2_3b_gsm8k.py train.max_steps=10
Hardware: one 16 GB CUDA GPU (`lowmem-grpo plan recipes/llama3_2_3b_gsm8k.py` prints the breakdown).
Planner:  peak 5.85 GiB with Unsloth (backend auto), 13.05 GiB with transformers + PEFT + bitsandbytes
          (model.backend=hf); not measured on a GPU yet.
Settings: 250 steps, completions up to 768 tokens; the rest, and the calculator option, lowmem_grpo/presets.py.
"""

from lowmem_grpo.presets import gsm8k_gpu


def recipe():
    """Llama-3.2-3B-Instruct, 16 GB GPU."""
    return gsm8k_gpu("llama3.2-3b-gsm8k", "meta-llama/Llama-3.2-3B-Instruct", gpu_memory_gb=16, max_steps=250,
                     max_completion_length=768)


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
