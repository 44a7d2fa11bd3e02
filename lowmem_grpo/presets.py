"""The shape the GPU recipes share (`gsm8k_gpu()`), so that each recipe module states only its model, card and numbers:
GRPO on GSM8K from the hub, a 4-bit base with LoRA r=16 on all projections, 2 prompts x 8 generations per step."""

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
