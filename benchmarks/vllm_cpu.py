"""vLLM's CPU build against lowmem_grpo's engine, and the sampler check's figures, on the CPU default's sampling shape.

    flock /tmp/heavy.lock .venv-vllm/bin/python benchmarks/vllm_cpu.py --run RUN_DIR --dtypes bfloat16 float32

RUN_DIR: a run of the CPU default. Per dtype: speed (completion tokens / wall s, best of --repeats, and start time)
of --prompts x --samples calculator rollouts through the engine (merged LoRA) and through vLLM (the trained adapter
as a LoRARequest); and the sampler check's |sampler - policy| log-prob (mean, max) with vLLM sampling under the
trained adapter, none, and the primed one (stale). Prints one table per dtype and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")


def vllm_rows(llm: Any, tokenizer: Any, ids: list[list[int]], request: Any, args: argparse.Namespace,
              seed: int) -> list[Any]:
    from lowmem_grpo.sampling.engine import Calculator
    from lowmem_grpo.sampling.vllm_calculator import EngineRounds, calculator_rows

    settings = {"temperature": args.temperature, "top_p": 1.0, "top_k": -1}
    return calculator_rows(EngineRounds(llm, settings, request), ids, max_tokens=args.tokens,
                           calculator=Calculator(tokenizer), eos_ids={tokenizer.eos_token_id}, seed=seed)


def engine_rows(model: Any, tokenizer: Any, ids: list[list[int]], args: argparse.Namespace) -> list[Any]:
    from lowmem_grpo.sampling.engine import Calculator, sample_rows
    from lowmem_grpo.sampling.generate import fast_sampling, inference_mode

    with inference_mode(model), fast_sampling(model):
        return sample_rows(model, ids, max_new_tokens=args.tokens, temperature=args.temperature,
                           eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id or 0,
                           calculator=Calculator(tokenizer))


def timed(fn: Any, repeats: int) -> tuple[float, int]:
    """(best tokens/s, completion tokens) of `repeats` calls of fn() -> rows."""
    best, tokens = 0.0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        rows = fn()
        tokens = sum(len(r.ids) for r in rows)
        best = max(best, tokens / (time.perf_counter() - start))
    return best, tokens


def run_dtype(dtype: str, args: argparse.Namespace) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_grpo.backends import locate_model
    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.evaluation.command import find_adapter
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.sampling.sampler_check import SamplerCheck, figures, policy_logprobs
    from lowmem_grpo.sampling.generate import inference_mode
    from lowmem_grpo.sampling.vllm_engine import EngineSpec, adapter_rank, lora_request, start_engine

    run = Path(args.run)
    trained, primed = find_adapter(run), run / "primed_adapter"
    recipe = load_recipe(RECIPE)
    path = locate_model(recipe.model.name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)),
                                      str(trained)).eval()
    examples = recipe_examples(load_train_rows(recipe.data), tokenizer, recipe.data)[:args.prompts]
    ids = [p for p in tokenizer(text=[ex["prompt"] for ex in examples])["input_ids"] for _ in range(args.samples)]
    start = time.perf_counter()
    llm = start_engine(EngineSpec(path, dtype, recipe.model.max_seq_length, max_lora_rank=adapter_rank(trained),
                                  max_num_seqs=len(ids)))
    started = time.perf_counter() - start
    live, stale = lora_request("trained", 1, trained), lora_request("primed", 2, primed)
    torch.manual_seed(0)
    vllm_speed, vllm_tokens = timed(lambda: vllm_rows(llm, tokenizer, ids, live, args, 0), args.repeats)
    engine_speed, engine_tokens = timed(lambda: engine_rows(model, tokenizer, ids, args), args.repeats)
    print(f"\n{dtype}: {args.prompts} prompts x {args.samples}, T {args.temperature}, <= {args.tokens} tokens, "
          f"calculator on; vLLM started in {started:.1f} s")
    print(f"  engine (merged LoRA)      {engine_speed:7.1f} tok/s ({engine_tokens} tokens)")
    print(f"  vLLM + LoRARequest        {vllm_speed:7.1f} tok/s ({vllm_tokens} tokens)")
    print("  sampler check: |sampler - policy (trained adapter)| log-prob per sampled token")
    for name, request in (("trained adapter (correct)", live), ("base weights", None), ("primed adapter (stale)",
                                                                                         stale)):
        rows = vllm_rows(llm, tokenizer, ids, request, args, 1)
        with inference_mode(model):
            policy = policy_logprobs(model, ids, [r.ids for r in rows], args.temperature)
        result = figures([r.logprobs for r in rows], policy)
        verdict = "passes" if result.mean <= SamplerCheck(dtype).tolerance else "STOPS"
        print(f"  {name:<26} mean {result.mean:.4f}  max {result.max:.3f}  ({result.tokens} tokens; check {verdict})")
    del llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a run directory of the CPU default")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    for dtype in args.dtypes:
        run_dtype(dtype, args)
    print(f"\nload average: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
