"""The first check of the CUDA path on a GPU machine (issue 13), in one call of at most 8 minutes.

On a model with random weights built from a shipped recipe's real config (benchmarks/memory_gpu.py: the real
shapes, so the real memory, without a download), each variant runs 3 GRPO steps through lowmem_grpo's train() in
its own process, with the recipe's settings:

  unsloth-4bit        backend unsloth, 4-bit base, generation with transformers (fast_inference off)
  unsloth-4bit-vllm   the same with vLLM generation (fast_inference on), when vllm imports there
  hf-4bit             backend hf (transformers + PEFT + bitsandbytes nf4) on the same settings
  hf-4bit-shared      hf without gradient checkpointing, where the shared-prompt pass can run the loss pass
                      (train.shared_prompt, the default: each distinct prompt of a micro-batch forwarded once)
  hf-4bit-unshared    the same with train.shared_prompt=false (every row forwarded whole)

and one table: peak torch.cuda.max_memory_allocated against the planner's prediction for that variant (allocated
bytes; the card's memory as the budget), the device memory in use, generated tokens per second, seconds per step,
and the per-phase timings (`time/<phase>` in metrics.jsonl) when the trainer logs them. Then the shared-prompt
pass on vs off (hf-4bit-shared vs hf-4bit-unshared): peak allocated memory measured and predicted (as if the pass
engaged, and not), the loss forward, backward and step times, and their ratios. Random weights never emit EOS: every completion runs to
max_completion_length, the planner's worst case.

On the lent GPU machine (the wheels from benchmarks/build_gpu_bundle.py; one `run` call, carry [".whl"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
    python3 benchmarks/gpu_check.py --recipe qwen2_5_1_5b_gsm8k --time-budget 420

vLLM is not in the bundle (its wheel alone is 321 MB, over the 64 MiB a call carries, and it pins torch 2.13.0
while that machine has 2.11): its row says so unless vllm imports. CI never runs this script; tests/test_gpu_path.py
checks its arguments and table on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_gpu: the model builder and the random reward
GIB = 2**30
VARIANTS = {
    "unsloth-4bit": ["model.backend=unsloth", "model.load_in_4bit=true", "model.fast_inference=false"],
    "unsloth-4bit-vllm": ["model.backend=unsloth", "model.load_in_4bit=true", "model.fast_inference=true"],
    "hf-4bit": ["model.backend=hf", "model.load_in_4bit=true", "model.fast_inference=false"],
    "hf-4bit-shared": ["model.backend=hf", "model.load_in_4bit=true", "model.fast_inference=false",
                       "train.gradient_checkpointing=false", "train.shared_prompt=true"],
    "hf-4bit-unshared": ["model.backend=hf", "model.load_in_4bit=true", "model.fast_inference=false",
                         "train.gradient_checkpointing=false", "train.shared_prompt=false"],
}
SHARED_PAIR = ("hf-4bit-shared", "hf-4bit-unshared")  # the shared-prompt pass on, off
SHARED_PHASES = ("time/loss_forward", "time/backward")
NO_VLLM = ("skipped: vllm does not import here (its 321 MB wheel is over the 64 MiB bundle, and vllm 0.31 pins "
           "torch 2.13.0)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the CUDA path's first check: memory, speed, both backends")
    parser.add_argument("--recipe", default="qwen2_5_1_5b_gsm8k", help="shipped GPU recipe (default qwen2_5_1_5b)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per variant (default 3)")
    parser.add_argument("--max-completion-length", type=int, default=256,
                        help="completion tokens (default 256, to fit the 8-minute call; 0 = the recipe's)")
    parser.add_argument("--time-budget", type=float, default=420, help="seconds for everything (default 420)")
    parser.add_argument("--workdir", default="/tmp/lowmem_gpu_check", help="model and runs (default /tmp/...)")
    parser.add_argument("--out", help="JSON results (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def planned_rows(variants: list[str], vllm_importable: bool) -> list[tuple[str, str | None]]:
    """(variant, reason it is skipped or None) in the order they run."""
    return [(v, NO_VLLM if v.endswith("-vllm") and not vllm_importable else None) for v in variants]


# --- one variant, in its own process -------------------------------------------------------------


def variant_recipe(args: argparse.Namespace, model_dir: Path, rows: Path, run_dir: Path):
    """The recipe of one variant: the shipped recipe's settings on the random-weight model and prompts."""
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    recipe = load_recipe(args.recipe)
    overrides = [f"model.name={model_dir}", f"data.source={rows}", "data.system_prompt=", "data.prefill=",
                 "rewards={memory_gpu:random_reward: 1.0}", f"train.max_steps={args.steps}",
                 "train.save_steps=100000", "train.logging_steps=1", "train.preflight=false",
                 "train.completions_every=0", "train.eval_every=0", f"output.dir={run_dir}", *VARIANTS[args.worker]]
    if args.max_completion_length:
        c = args.max_completion_length
        overrides += [f"train.max_completion_length={c}", f"model.max_seq_length={recipe.data.max_prompt_length + c}"]
    return apply_overrides(recipe, overrides)


def phase_times(logs: list[dict]) -> dict[str, float]:
    """Mean of each `time/<phase>` key over the logged steps after the first (which also compiles kernels)."""
    steps = [log for log in logs if log.get("stage", "grpo") == "grpo" and ("step_time" in log
                                                                          or any(k.startswith("time/") for k in log))]
    timed = steps[1:] or steps
    keys = sorted({k for log in timed for k in log if k.startswith("time/")})
    return {k: round(sum(log[k] for log in timed if k in log) / sum(1 for log in timed if k in log), 3)
            for k in keys}


def speed(logs: list[dict], generation_batch: int) -> dict[str, float | None]:
    """Seconds per step and generated tokens per second: completion tokens of the step over the generation
    phase's time when it is logged (time/generation), else over the whole step."""
    steps = [log for log in logs if log.get("stage", "grpo") == "grpo" and "step_time" in log]
    timed = steps[1:] or steps
    if not timed:
        return {"step_s": None, "tokens_per_s": None}
    rates = []
    for log in timed:
        seconds = log.get("time/generation") or log["step_time"]
        if seconds:
            rates.append(log.get("completions/mean_length", 0) * generation_batch / seconds)
    return {"step_s": round(sum(log["step_time"] for log in timed) / len(timed), 2),
            "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else None}


def unsloth_facts() -> dict:
    """What Unsloth chose at run time: xformers, and which log-prob kernel paths ran (memory term 5)."""
    facts = {}
    utils = sys.modules.get("unsloth.models._utils")
    if utils is not None:
        facts["xformers"] = getattr(utils, "xformers_version", None) or "off (PyTorch attention)"
    fused = sys.modules.get("unsloth_zoo.fused_losses.fused_linear")
    if fused is not None:
        facts["logprob_kernel_calls"] = dict(getattr(fused, "CALLS", {}))
    return facts


def worker(args: argparse.Namespace) -> int:
    """One variant in this process: prints one `RESULT {json}` line."""
    import torch

    from memory_gpu import build_model_dir, probe_callback, write_rows

    work = Path(args.workdir)
    result = {"variant": args.worker, "recipe": args.recipe}
    started = time.monotonic()
    try:
        model_dir = work / f"model-{args.recipe}"
        build_model_dir(args.recipe, model_dir)  # once; the next variants reuse it
        from lowmem_grpo.recipe_io import load_recipe

        rows = work / f"{args.recipe}.jsonl"
        write_rows(rows, load_recipe(args.recipe).data.max_prompt_length)
        recipe = variant_recipe(args, model_dir, rows, work / f"run-{args.worker}-{time.time_ns()}")
        probe = probe_callback()
        from lowmem_grpo.train.pipeline import train

        run_dir = train(recipe, callbacks=[probe])
        total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 8 * GIB
        from lowmem_grpo.memory.plan import plan

        predicted = plan(recipe, total)
        logs = _metrics(run_dir)  # metrics.jsonl: the trainer's logs plus any time/<phase> keys
        result.update(probe.peaks, **speed(logs, recipe.train.generation_batch_size()), phases=phase_times(logs),
                      predicted_allocated=predicted.allocated_bytes, predicted_total=predicted.total_bytes,
                      peak_phase=predicted.peak_phase, steps=sum(1 for log in probe.logs if "step_time" in log),
                      prompt_sharing=predicted.sharing_dict(), **predicted_sharing(predicted),
                      **unsloth_facts())
    except Exception as exc:  # reported in the table; the next variant goes on
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def predicted_sharing(predicted) -> dict:
    """The planner's allocated bytes with the shared-prompt pass engaged and not (a CUDA plan counts ours as off)."""
    import dataclasses

    from lowmem_grpo.memory.plan import evaluate

    s = predicted.settings
    on = dataclasses.replace(s, prompt_sharing=predicted.sharing.available, sharing_verify=predicted.sharing.verify)
    off = dataclasses.replace(s, prompt_sharing="none", sharing_verify=False)
    return {"predicted_allocated_shared": evaluate(predicted.architecture, on).allocated_bytes,
            "predicted_allocated_unshared": evaluate(predicted.architecture, off).allocated_bytes}


def _metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- the table -----------------------------------------------------------------------------------


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def _err(measured, predicted) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def table(results: list[dict]) -> str:
    """One row per variant; the `time/<phase>` columns that any result has, after the fixed ones."""
    phases = sorted({k for r in results for k in r.get("phases", {})})
    head = ["variant", "steps", "pred alloc", "max alloc", "err", "pred total", "device used", "tok/s", "s/step",
            *phases]
    rows = [head]
    for r in results:
        if "error" in r or "skipped" in r:
            rows.append([r["variant"], r.get("error") or r.get("skipped")])
            continue
        rows.append([r["variant"], str(r.get("steps", "-")), _gib(r.get("predicted_allocated")),
                     _gib(r.get("max_allocated")), _err(r.get("max_allocated"), r.get("predicted_allocated")),
                     _gib(r.get("predicted_total")), _gib(r.get("device_used")), str(r.get("tokens_per_s") or "-"),
                     str(r.get("step_s") or "-"), *[str(r.get("phases", {}).get(p, "-")) for p in phases]])
    widths = [max(len(row[i]) for row in rows if len(row) == len(head)) for i in range(len(head))]
    lines = []
    for row in rows:
        if len(row) != len(head):  # a skipped or failed variant: its reason on one line
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
            continue
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
    notes = ("(GiB; err = (predicted - measured) / measured; pred total adds what torch does not count: CUDA "
             "context, vLLM's pool, allocator slack; tok/s = generated tokens per second of generation time when "
             "time/generation is logged, else of step time)")
    return "\n".join(lines) + "\n" + notes + "\n"


def _ratio(on, off) -> str:
    return f"{on / off:.2f}" if isinstance(on, (int, float)) and isinstance(off, (int, float)) and off else "-"


def sharing_table(results: list[dict]) -> str:
    """The shared-prompt pass on vs off (SHARED_PAIR): peak allocated memory, measured and predicted, the loss
    forward, backward and step seconds, and on/off ratios; empty unless both variants ran."""
    by = {r["variant"]: r for r in results if "error" not in r and "skipped" not in r}
    if not all(v in by for v in SHARED_PAIR):
        return ""
    on, off = (by[v] for v in SHARED_PAIR)
    rows = [("", "on", "off", "on/off")]
    rows.append(("max alloc GiB", _gib(on.get("max_allocated")), _gib(off.get("max_allocated")),
                 _ratio(on.get("max_allocated"), off.get("max_allocated"))))
    pred_on, pred_off = on.get("predicted_allocated_shared"), off.get("predicted_allocated_unshared")
    rows.append(("pred alloc GiB", _gib(pred_on), _gib(pred_off), _ratio(pred_on, pred_off)))
    for key in SHARED_PHASES:
        a, b = on.get("phases", {}).get(key), off.get("phases", {}).get(key)
        rows.append((f"{key} s", str(a if a is not None else "-"), str(b if b is not None else "-"), _ratio(a, b)))
    rows.append(("s/step", str(on.get("step_s") or "-"), str(off.get("step_s") or "-"),
                 _ratio(on.get("step_s"), off.get("step_s"))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"shared-prompt pass ({SHARED_PAIR[0]} on, {SHARED_PAIR[1]} off): "
             f"{(on.get('prompt_sharing') or {}).get('reason', '')}"]
    lines += ["  " + "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
              for r in rows]
    return "\n".join(lines) + "\n"


# --- the orchestrator ----------------------------------------------------------------------------


def run_variant(args: argparse.Namespace, variant: str, seconds: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--recipe", args.recipe,
           "--steps", str(args.steps), "--max-completion-length", str(args.max_completion_length),
           "--workdir", args.workdir]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, cwd=args.workdir)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": "stopped at --time-budget"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):])
    return {"variant": variant, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    deadline = time.monotonic() + args.time_budget
    results = []
    for variant, skipped in planned_rows(args.variants.split(","), importlib.util.find_spec("vllm") is not None):
        left = deadline - time.monotonic()
        if skipped or left < 30:
            results.append({"variant": variant, "skipped": skipped or "skipped: out of --time-budget"})
            continue
        print(f"== {variant} ({left:.0f} s left)", flush=True)
        results.append(run_variant(args, variant, left))
        print(json.dumps(results[-1]), flush=True)
    sys.stdout.write(table(results) + sharing_table(results))
    out = args.out or (os.environ["OUT"] + "/gpu_check.json" if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
