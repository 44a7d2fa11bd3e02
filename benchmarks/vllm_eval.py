"""`eval --engine vllm` against the project's engine on the same problems: paired accuracy and the sampler check.

    .venv-vllm/bin/python benchmarks/vllm_eval.py RUN_DIR --limit 64 [key=value ...]

Evaluates RUN_DIR's adapter twice, greedy with seed 0, with `lowmem-grpo eval`'s own flow: --engine transformers,
then --engine vllm (which runs the sampler check first). Prints the CPU (AMX or not), each engine's strict
accuracy, the paired difference vLLM - engine with its 95% bootstrap CI, how many texts differ and which way their
verdicts flipped, vLLM's base and the check's figures; exit 2 with the check's error when vLLM is refused. The two
evaluations stay under --out (default: a temporary folder).

Then (unless --no-departures) which engine writes the policy's greedy text: both engines' greedy rows on the same
problems (vLLM: the adapter as a LoRARequest; the engine: the merged LoRA it evaluates with), scored by the policy
(base + unmerged PEFT adapter in the evaluation's dtype). A row departs where the policy ranks the token written
(forced calculator tokens aside) below its own first choice.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cpu_line() -> str:
    """The CPU's model name and whether it has AMX (amx_bf16) and native bfloat16 (avx512_bf16)."""
    text = Path("/proc/cpuinfo").read_text(encoding="utf-8") if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return f"{name}; amx_bf16: {'yes' if 'amx_bf16' in flags else 'no'}; " \
           f"avx512_bf16: {'yes' if 'avx512_bf16' in flags else 'no'}"


def per_problem(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out_dir / "eval.jsonl").read_text(encoding="utf-8").splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--out", help="folder for the two evaluations (default: a temporary one)")
    parser.add_argument("--no-departures", dest="departures", action="store_false",
                        help="skip the policy's scoring of both engines' greedy rows")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both, e.g. model.dtype=float32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from lowmem_grpo.errors import VllmSamplerError
    from lowmem_grpo.evaluation.command import EvalOptions, run
    from lowmem_grpo.evaluation.metrics import paired_bootstrap

    out = Path(args.out or tempfile.mkdtemp(prefix="vllm_eval_"))
    options = dict(model=args.run_dir, limit=args.limit, progress=False, overrides=tuple(args.overrides))
    reports = {}
    for engine in ("transformers", "vllm"):
        try:
            reports[engine] = run(EvalOptions(**options, engine=engine, out=str(out / engine)))
        except VllmSamplerError as exc:
            print(f"CPU: {cpu_line()}\nvLLM refused by the sampler check: {exc}")
            return exc.exit_code
    rows = {engine: per_problem(out / engine) for engine in reports}
    ours, theirs = ([float(r["strict_correct"]) for r in rows[e]] for e in ("transformers", "vllm"))
    change = paired_bootstrap(ours, theirs)
    differ = [(a, b) for a, b in zip(rows["transformers"], rows["vllm"]) if a["completion"] != b["completion"]]
    lost = sum(a["strict_correct"] and not b["strict_correct"] for a, b in differ)
    won = sum(b["strict_correct"] and not a["strict_correct"] for a, b in differ)
    settings = reports["vllm"]["settings"]
    check = settings["sampler_check"]
    print(f"CPU: {cpu_line()}")
    print(f"{args.run_dir}: {len(ours)} problems, greedy, {settings['dtype']}")
    print(f"strict accuracy: engine {sum(ours) / len(ours):.3f}, vLLM {sum(theirs) / len(theirs):.3f}; "
          f"vLLM - engine {change['diff']:+.3f} [{change['low']:+.3f}, {change['high']:+.3f}] (95% paired bootstrap)")
    print(f"texts that differ: {len(differ)}; right -> wrong on vLLM: {lost}; wrong -> right: {won}")
    print(f"vLLM's base: {settings['vllm_base']['path']} ({settings['vllm_base']['note']})")
    print("sampler check: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in check.items()))
    print(f"evaluations in {out}")
    if args.departures:
        print(departures(args.run_dir, args.limit, tuple(args.overrides)))
    return 0


def departures(run_dir: str, limit: int, overrides: tuple[str, ...]) -> str:
    """Per engine: rows whose every sampled token is the policy's first choice, tokens it ranks below its first
    choice, and the largest gap (nats)."""
    import torch

    from lowmem_grpo import distributed
    from lowmem_grpo.backends import load, start
    from lowmem_grpo.data import load_eval_rows, recipe_examples
    from lowmem_grpo.evaluation.command import EvalOptions, load_model, resolve
    from lowmem_grpo.evaluation.vllm_check import sample_check_rows
    from lowmem_grpo.sampling.engine import Calculator, sample_rows
    from lowmem_grpo.sampling.generate import eos_ids, fast_sampling, inference_mode
    from lowmem_grpo.sampling.sampler_check import policy_scores

    opts = EvalOptions(model=run_dir, limit=limit, engine="vllm", progress=False, overrides=overrides)
    recipe, adapter, found = resolve(opts)
    runtime, _ = start(recipe, distributed.launch(recipe.train.extra), training=False)
    llm, tokenizer, lora, _ = load_model(recipe, adapter, opts, runtime, found)
    prompts = [ex["prompt"] for ex in recipe_examples(load_eval_rows(recipe.data, split=recipe.data.eval_split,
                                                                     limit=limit), tokenizer, recipe.data)]
    budget = recipe.train.max_completion_length
    ids, on_vllm = sample_check_rows(llm, lora, tokenizer, prompts, temperature=0.0, seed=0, max_new_tokens=budget,
                                     calculator=recipe.data.calculator)
    del llm
    policy = load(recipe, runtime, with_lora=False, adapter_path=str(adapter)).model
    calculator = Calculator(tokenizer) if recipe.data.calculator else None
    with inference_mode(policy), torch.no_grad():
        with fast_sampling(policy) as merge:
            on_engine = sample_rows(policy, ids, max_new_tokens=budget, temperature=0.0,
                                    eos_ids=eos_ids(policy, tokenizer), pad_id=tokenizer.pad_token_id or 0,
                                    calculator=calculator)
        lines = [f"which engine writes the policy's greedy text ({len(ids)} problems, {runtime.dtype}; the "
                 f"engine {merge.describe()}):"]
        for name, rows in (("engine", on_engine), ("vLLM", on_vllm)):
            scores = policy_scores(policy, ids, [r.ids for r in rows], 0.0)
            gaps = [[best - chosen for chosen, best, forced in zip(c, b, r.forced) if not forced]
                    for (c, b), r in zip(scores, rows)]
            kept = sum(all(g <= 0.0 for g in row) for row in gaps)
            below = sum(g > 0.0 for row in gaps for g in row)
            tokens = sum(len(row) for row in gaps)
            worst = max((g for row in gaps for g in row), default=0.0)
            lines.append(f"  {name:<7} rows all the policy's first choices: {kept} of {len(rows)}; tokens below it: "
                         f"{below} of {tokens}; largest gap {worst:.3f} nats")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
