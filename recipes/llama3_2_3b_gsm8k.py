"""Llama-3.2-3B-Instruct on GSM8K with GRPO: Llama 3.2 3B with longer completions (gated on the hub:
accept its license and set HF_TOKEN).

Run:      lowmem-grpo train recipes/llama3_2_3b_gsm8k.py
          python recipes/llama3_2_3b_gsm8k.py train.max_steps=10
Hardware: tuned for one 16 GB CUDA GPU (`lowmem-grpo plan recipes/llama3_2_3b_gsm8k.py` prints the breakdown).
Planner:  predicted peak 5.85 GiB with Unsloth (backend auto), 13.05 GiB with plain
          transformers + PEFT + bitsandbytes (model.backend=hf); the rest of the 16 GB is headroom until
          benchmarks/memory_gpu.py has measured this architecture.
Settings: 4-bit nf4 base, LoRA r=16 on all projections, 2 prompts x 8 generations per step,
          completions up to 768 tokens.
Option:   the calculator reward, scoring the choice of operation with exact arithmetic:
          `lowmem-grpo train RECIPE "rewards={correctness: 2.0, expression: 1.0, strict_format: 0.5}"`
          (docs/rewards.md); the calculator in the sampling loop (data.calculator=true) runs on either backend,
          with plain sampling at train.temperature. Neither has been run on a GPU yet.
"""

from lowmem_grpo.recipe import DataConfig, LoraConfig, ModelConfig, OutputConfig, Recipe, TrainConfig


def recipe() -> Recipe:
    """Llama-3.2-3B-Instruct, 16 GB GPU."""
    return Recipe(
        name="llama3.2-3b-gsm8k",
        description="Llama-3.2-3B-Instruct on GSM8K (hub), 4-bit + LoRA, 16 GB GPU",
        gpu_memory_gb=16,
        model=ModelConfig(name="meta-llama/Llama-3.2-3B-Instruct", backend="auto", load_in_4bit=True,
                          max_seq_length=1024),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="hub", max_prompt_length=256),
        train=TrainConfig(max_steps=250, num_generations=8, per_device_train_batch_size=16,
                          max_completion_length=768, learning_rate=5e-6, save_steps=50),
        output=OutputConfig(root="runs"),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
