"""Qwen2.5-1.5B-Instruct on GSM8K with a calculator in the loop: priming on GSM8K's own worked solutions, then GRPO.

Run:      lowmem-grpo train recipes/qwen2_5_1_5b_gsm8k_calc.py
          python recipes/qwen2_5_1_5b_gsm8k_calc.py train.max_steps=10
Hardware: one 8 GB CUDA GPU (`lowmem-grpo plan recipes/qwen2_5_1_5b_gsm8k_calc.py` prints the breakdown, the
          evaluation batch included). It has not run on a GPU yet: every figure here is the planner's.
Planner:  predicted peak 7.02 GiB with Unsloth (backend auto), 6.59 GiB with plain
          transformers + PEFT + bitsandbytes (model.backend=hf); both peaks are the stage evaluation's, whose batch
          the plan cuts to the card (the GRPO step alone: 3.13 and 6.29 GiB).
Calculator: data.calculator: the model writes `<<48/2=`, lowmem_grpo's sampling engine forces the exact `24>>` into
          the row (GSM8K's own calculator annotations), in GRPO's rollouts, the reward preflight and every
          evaluation; GRPO keeps those tokens out of its loss. So the arithmetic is exact and the reward lands on
          the choice of operation and operands. The engine samples, so vLLM stays off (model.fast_inference=false).
Priming:  the format and the annotations on 320 of GSM8K's own worked solutions (the hub's `answer` field keeps
          `<<48/2=24>>`; priming renders `Natalia sold <<48/2=24>>24 clips`, what the calculator completes).
Rewards:  correctness 1.0 (the goal), expression 1.0 (the exact value of the reasoning's last calculation against
          the gold answer: GSM8K's worked solutions end on the calculation of their answer), strict_format 0.1.
Stages:   train.eval.stage.problems=200: base / primed / trained on the same held-out test problems, greedy and
          4 samples at the training temperature, in report.md.
Settings: 300 steps, completions up to 512 tokens; the rest, lowmem_grpo/presets.py's (recipes/qwen2_5_1_5b_gsm8k.py
          with the calculator, priming, these rewards and the stage evaluations).
"""

from dataclasses import replace

from lowmem_grpo.presets import gsm8k_gpu
from lowmem_grpo.recipe import EvalConfig, PrimeConfig, StageEvalConfig


def recipe():
    """Qwen2.5-1.5B-Instruct, 8 GB GPU, the calculator in the sampling loop."""
    base = gsm8k_gpu("qwen2.5-1.5b-gsm8k-calc", "Qwen/Qwen2.5-1.5B-Instruct", gpu_memory_gb=8, max_steps=300)
    return replace(
        base,
        description="Qwen2.5-1.5B-Instruct on GSM8K (hub) with a calculator in the loop, 4-bit + LoRA, 8 GB GPU",
        model=replace(base.model, fast_inference=False),
        data=replace(base.data, prefill="<reasoning>\n", calculator=True),
        prime=PrimeConfig(enabled=True, max_steps=40, num_examples=320, learning_rate=2e-4,
                          per_device_train_batch_size=8),
        rewards={"correctness": 1.0, "expression": 1.0, "strict_format": 0.1},
        train=replace(base.train, eval=EvalConfig(stage=StageEvalConfig(problems=200))),
    )


if __name__ == "__main__":
    from lowmem_grpo.cli import main_for_recipe

    raise SystemExit(main_for_recipe(__file__))
