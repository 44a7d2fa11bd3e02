"""torch.profiler tables of one GRPO step and one evaluation of the CPU default, as the package runs them.

    OMP_NUM_THREADS=2 python benchmarks/profile_cpu.py --what step --out /tmp/profile-step
    OMP_NUM_THREADS=2 python benchmarks/profile_cpu.py --what eval --out /tmp/profile-eval
    OMP_NUM_THREADS=2 python benchmarks/profile_cpu.py --what decode --out /tmp/decode --repeats 2

`step`: train() of recipes/smollm2_135m_arith_cpu.py (no preflight, no stage evaluation, its priming as shipped),
profiled over GRPO step --profile-step (a later step: the first pays one-off costs); the table of the operators
with the most self CPU time goes to stdout and to OUT/step.txt. `eval`: greedy + --samples samples at the training
temperature on --problems test problems of the same recipe through lowmem_grpo.sampling.generate (the base
model), at the stage evaluation's batch size; OUT/eval.txt. `decode`: the engine's decode loop with transformers'
DynamicCache and with the preallocated cache, alternating in one process on the same prompts and seeds, with
whether their rows are identical; OUT/decode.txt. --set KEY=VALUE changes the recipe (another shape).
Prints the load average before and after: a table taken on busy cores is noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile
from transformers import TrainerCallback  # the embedded CPU default runs the hf backend: no Unsloth to import first

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2_135m_arith_cpu.py"
ROWS = 30


def _table(profiler, title: str) -> str:
    events = profiler.key_averages()
    return f"{title}\n" + events.table(sort_by="self_cpu_time_total", row_limit=ROWS)


class StepProfiler(TrainerCallback):
    """Profiles GRPO step `step` (train()'s callback seam) and writes its table to OUT/step.txt."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.started = time.perf_counter()
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.profiler.__exit__(None, None, None)
            text = _table(self.profiler, f"GRPO step {self.step}: {time.perf_counter() - self.started:.2f} s wall")
            (self.out / "step.txt").write_text(text)
            sys.stdout.write(text + "\n")


def profile_step(args: argparse.Namespace, out: Path) -> None:
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe
    from lowmem_grpo.train.pipeline import train

    overrides = [f"train.max_steps={args.profile_step}", "train.preflight=false", "train.stage_eval=0",
                 "train.save_steps=1000", f"output.dir={out / 'run'}", *args.set]
    recipe = apply_overrides(load_recipe(str(RECIPE)), overrides)
    train(recipe, callbacks=[StepProfiler(args.profile_step, out)])


def profile_eval(args: argparse.Namespace, out: Path) -> None:
    import torch

    from lowmem_grpo.sampling.generate import generate
    from lowmem_grpo.evaluation.stages import EVAL_BATCH

    loaded, prompts, recipe = _eval_setup(args)
    t = recipe.train
    common = dict(max_new_tokens=t.max_completion_length, progress=False, calculator=recipe.data.calculator)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        generate(loaded.model, loaded.tokenizer, prompts, batch_size=EVAL_BATCH, **common)
        greedy = time.perf_counter() - start
        start = time.perf_counter()
        generate(loaded.model, loaded.tokenizer, prompts, batch_size=EVAL_BATCH, num_samples=args.samples,
                 temperature=t.temperature, seed=t.seed, **common)
        sampled = time.perf_counter() - start
    text = _table(prof, f"evaluation of {len(prompts)} problems ({loaded.dtype}, torch threads "
                        f"{torch.get_num_threads()}): greedy {greedy:.1f} s, {args.samples} samples {sampled:.1f} s")
    (out / "eval.txt").write_text(text)
    sys.stdout.write(text + "\n")


def compare_decode(args: argparse.Namespace, out: Path) -> None:
    """The engine's decode with transformers' DynamicCache (before) and with the preallocated cache (after), in
    one process, alternating, on the same prompts and seeds: greedy over --problems, then --samples samples each
    at the training temperature, in the stage evaluation's batches, with the LoRA-free base model. Prints the
    seconds of each and whether the rows are identical."""
    import torch

    from lowmem_grpo.sampling.engine import DecodeContract, sample_rows
    from lowmem_grpo.sampling.generate import fast_sampling

    loaded, prompts, recipe = _eval_setup(args)
    ids = loaded.tokenizer(prompts)["input_ids"]
    eos = {loaded.tokenizer.eos_token_id}
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else min(eos)
    t = recipe.train
    from lowmem_grpo.evaluation.stages import EVAL_BATCH

    def run(preallocate: bool, k: int, temperature: float) -> tuple[float, list[list[int]]]:
        rows, start = [], time.perf_counter()
        per = max(1, EVAL_BATCH // k)
        with fast_sampling(loaded.model):
            for i in range(0, len(ids), per):
                batch = [p for p in ids[i:i + per] for _ in range(k)]
                rows += sample_rows(loaded.model, batch, max_new_tokens=t.max_completion_length,
                                    temperature=temperature, eos_ids=eos, pad_id=pad,
                                    generator=torch.Generator().manual_seed(t.seed),
                                    contract=DecodeContract(preallocate=preallocate))
        return time.perf_counter() - start, [r.ids for r in rows]

    loaded.model.eval()
    lines = []
    for label, k, temperature in (("greedy", 1, 0.0), (f"{args.samples} samples", args.samples, t.temperature)):
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs = {}
        for _ in range(args.repeats):
            for preallocate in (False, True):
                seconds, outputs[preallocate] = run(preallocate, k, temperature)
                times[preallocate].append(seconds)
        same = outputs[False] == outputs[True]
        lines.append(f"{label:10s} DynamicCache {min(times[False]):6.1f} s  preallocated {min(times[True]):6.1f} s  "
                     f"(min of {args.repeats}; ratio {min(times[True]) / min(times[False]):.2f}); rows identical: {same}")
    text = f"decode of {len(ids)} problems, {loaded.dtype}, batch {EVAL_BATCH} sequences\n" + "\n".join(lines)
    (out / "decode.txt").write_text(text)
    sys.stdout.write(text + "\n")


def _eval_setup(args: argparse.Namespace):
    from lowmem_grpo.backends import load, resolve_model_path, start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.data import load_eval_rows, recipe_examples
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    recipe = apply_overrides(load_recipe(str(RECIPE)), list(args.set))
    loaded = load(recipe, start(recipe, Launch())[0], model_path=resolve_model_path(recipe.model.name))
    rows = load_eval_rows(recipe.data)[:args.problems]
    prompts = [e["prompt"] for e in recipe_examples(rows, loaded.tokenizer, recipe.data)]
    return loaded, prompts, recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=["step", "eval", "decode"], required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile-step", type=int, default=3)
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"load average before: {os.getloadavg()[0]:.2f}\n")
    {"step": profile_step, "eval": profile_eval, "decode": compare_decode}[args.what](args, args.out)
    sys.stdout.write(f"load average after: {os.getloadavg()[0]:.2f}\n")


if __name__ == "__main__":
    main()
