"""The shape the GPU recipes share, so that each recipe module states only its model, its card and its numbers.

`gsm8k_gpu()` builds GRPO on GSM8K from the hub for one CUDA GPU: a 4-bit nf4 base with LoRA r=16 (alpha 32) on all
projections, 2 prompts x 8 generations per step (a batch of 16), prompts up to 256 tokens and room in the sequence for
the prompt and the longest completion, learning rate 5e-6, a checkpoint every 50 steps, backend auto (Unsloth where it
runs, else transformers + PEFT + bitsandbytes).

Option on every such recipe: the calculator reward, scoring the choice of operation with exact arithmetic:
`lowmem-grpo train RECIPE "rewards={correctness: 2.0, expression: 1.0, strict_format: 0.5}"` (docs/rewards.md); the
calculator in the sampling loop (data.calculator=true) runs on either backend, with plain sampling at
train.temperature (recipes/qwen2_5_1_5b_gsm8k_calc.py is the recipe built for it).
"""

from __future__ import annotations

from lowmem_grpo.recipe import DataConfig, LoraConfig, ModelConfig, OutputConfig, Recipe, TrainConfig

GSM8K_PROMPT_TOKENS = 256


def gsm8k_gpu(name: str, model: str, *, gpu_memory_gb: int, max_steps: int,
              max_completion_length: int = 512) -> Recipe:
    """GRPO on GSM8K (hub) for `model` (a hub id) on one `gpu_memory_gb` GB GPU; the run is called `name`."""
    return Recipe(
        name=name,
        description=f"{model.rpartition('/')[2]} on GSM8K (hub), 4-bit + LoRA, {gpu_memory_gb} GB GPU",
        gpu_memory_gb=gpu_memory_gb,
        model=ModelConfig(name=model, backend="auto", load_in_4bit=True,
                          max_seq_length=GSM8K_PROMPT_TOKENS + max_completion_length),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="hub", max_prompt_length=GSM8K_PROMPT_TOKENS),
        train=TrainConfig(max_steps=max_steps, num_generations=8, per_device_train_batch_size=16,
                          max_completion_length=max_completion_length, learning_rate=5e-6, save_steps=50),
        output=OutputConfig(root="runs"),
    )
