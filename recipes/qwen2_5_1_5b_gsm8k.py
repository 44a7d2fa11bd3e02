"""Qwen2.5-1.5B-Instruct on GSM8K with GRPO: the smallest Qwen2.5 that learns the format quickly.

Run:      lowmem-grpo train recipes/qwen2_5_1_5b_gsm8k.py
          python recipes/qwen2_5_1_5b_gsm8k.py train.max_steps=10
Hardware: tuned for one 8 GB CUDA GPU (`lowmem-grpo plan recipes/qwen2_5_1_5b_gsm8k.py` prints the breakdown).
Planner:  predicted peak 3.13 GiB with Unsloth (backend auto), 6.29 GiB with plain
          transformers + PEFT + bitsandbytes (model.backend=hf); the rest of the 8 GB is headroom until
          benchmarks/memory_gpu.py has measured this architecture.
Settings: 4-bit nf4 base, LoRA r=16 on all projections, 2 prompts x 8 generations per step,
          completions up to 512 tokens.
Option:   the calculator reward, scoring the choice of operation with exact arithmetic:
          `lowmem-grpo train RECIPE "rewards={correctness: 2.0, expression: 1.0, strict_format: 0.5}"`
          (docs/rewards.md); the calculator in the sampling loop (data.calculator=true) runs on either backend,
          with plain sampling at train.temperature. Neither has been run on a GPU yet.
"""

from lowmem_grpo.recipe import DataConfig, LoraConfig, ModelConfig, OutputConfig, Recipe, TrainConfig


def recipe() -> Recipe:
    """Qwen2.5-1.5B-Instruct, 8 GB GPU."""
    return Recipe(
        name="qwen2.5-1.5b-gsm8k",
        description="Qwen2.5-1.5B-Instruct on GSM8K (hub), 4-bit + LoRA, 8 GB GPU",
        gpu_memory_gb=8,
        model=ModelConfig(name="Qwen/Qwen2.5-1.5B-Instruct", backend="auto", load_in_4bit=True, max_seq_length=768),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="hub", max_prompt_length=256),
        train=TrainConfig(max_steps=300, num_generations=8, per_device_train_batch_size=16,
                          max_completion_length=512, learning_rate=5e-6, save_steps=50),
        output=OutputConfig(root="runs"),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
