"""The loss pass's forward + backward with the shared-prompt log-prob pass on and off, like for like in one process.

    OMP_NUM_THREADS=1 python benchmarks/shared_prompt_cpu.py                  # the CPU default's shape
    OMP_NUM_THREADS=1 python benchmarks/shared_prompt_cpu.py --dtype float32 --repeats 5

One trainer, built by lowmem_grpo from the CPU default recipe (recipes/smollm2_135m_arith_cpu.py: the embedded
SmolLM2-135M with its LoRA adapter, train.gradient_checkpointing=false), scores one micro-batch shaped like the
default's: --prompts prompts x --generations completions (32 rows), prompts left-padded to --prompt-length tokens
(the shorter ones a few tokens shorter), completions of --completion-min..--completion-max tokens right-padded.
Each repeat runs both configurations in alternating order through the trainer's own log-prob pass
(`_get_per_token_logps_and_entropies`, with the entropy, as TRL's loss calls it) and a GRPO-style loss, then
backward. Printed per configuration: forward, backward and total seconds (median and minimum over the repeats),
the rise of peak RSS over the RSS before the pass (Linux VmHWM, reset before each pass; large blocks go straight
back to the OS, so it follows live memory), the token positions the pass forwarded; then the ratios full/shared
and the largest log-prob difference between the two; in a 16-bit dtype, where any two kernels round differently,
both passes' error against the full-row pass of a float32 copy of the model. The load average is printed before, during and after: on shared
cores read the ratios and the CPU seconds (one thread: OMP_NUM_THREADS=1 keeps other processes' load from
turning into spin-waits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2_135m_arith_cpu.py"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def make_batch(tokenizer, prompts: int, generations: int, prompt_length: int, completion: tuple[int, int],
               seed: int):
    """Rows as TRL builds them: each prompt left-padded to the longest, repeated `generations` times, completions
    right-padded with their masks; random token ids (the timing depends on the shapes only)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pad = tokenizer.pad_token_id
    width = completion[1]
    ids, mask = [], []
    for p in range(prompts):
        length = prompt_length - (p * 3) % 7  # prompts of slightly different lengths: real left padding
        prompt = torch.randint(3, len(tokenizer), (length,), generator=gen)
        for _ in range(generations):
            kept = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=gen))
            body = torch.randint(3, len(tokenizer), (kept,), generator=gen)
            ids.append(torch.cat([torch.full((prompt_length - length,), pad), prompt, body,
                                  torch.full((width - kept,), pad)]))
            mask.append(torch.cat([torch.zeros(prompt_length - length, dtype=torch.long),
                                   torch.ones(length + kept, dtype=torch.long),
                                   torch.zeros(width - kept, dtype=torch.long)]))
    return torch.stack(ids), torch.stack(mask), width


def build_trainer(dtype: str, run_dir: Path):
    """The hf CPU trainer lowmem_grpo builds for the CPU default recipe."""
    from lowmem_grpo import backends
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(str(RECIPE), [f"model.dtype={dtype}", f"output.dir={run_dir}"])
    runtime, _ = backends.start(recipe, Launch())
    from datasets import Dataset

    from lowmem_grpo.train.grpo import trainer_factory

    loaded = backends.load(recipe, runtime)
    dataset = Dataset.from_list([{"prompt": "x"}] * 16)

    def zero(completions, **_):
        return [0.0] * len(completions)

    trainer = trainer_factory(loaded, dataset, run_dir, [zero], [1.0], [])(recipe)
    trainer.model.train()
    return trainer, loaded


def one_pass(trainer, ids, mask, width: int, share: bool, advantages) -> dict:
    """Forward (log-probs + entropy + loss) and backward of one micro-batch; seconds, peak RSS rise, tokens."""
    trainer.lowmem_shared_prompt = share
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    completion_mask = mask[:, -width:]
    tracked = _reset_peak()
    before = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width,
                                                                     compute_entropy=True)
    ratio = (logps - logps.detach()).exp()  # the GRPO surrogate at the sampling policy
    loss = -((ratio * advantages.unsqueeze(1)) * completion_mask).sum() / completion_mask.sum()
    t1, c1 = time.perf_counter(), time.process_time()
    loss.backward()
    t2, c2 = time.perf_counter(), time.process_time()
    peak = _status_kib("VmHWM") - before if tracked else None
    saved = trainer._metrics["train"].get("shared_prompt/tokens_saved", [0.0])[-1]
    return {"forward": t1 - t0, "backward": t2 - t1, "total": t2 - t0, "cpu forward": c1 - c0,
            "cpu backward": c2 - c1, "cpu total": c2 - c0, "peak_mib": peak and peak / 1024,
            "forwarded": round(ids.numel() * (1 - saved)), "logps": logps.detach(),
            "entropy": float((entropies * completion_mask).sum() / completion_mask.sum())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="model.dtype (auto = bfloat16 where the CPU has it)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=83)
    parser.add_argument("--completion-min", type=int, default=46)
    parser.add_argument("--completion-max", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # peak RSS that follows live memory (see docstring)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.path.insert(0, str(REPO))
    import torch

    print(f"load before: {os.getloadavg()}  torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as work:
        trainer, loaded = build_trainer(args.dtype, Path(work) / "run")
        ids, mask, width = make_batch(loaded.tokenizer, args.prompts, args.generations, args.prompt_length,
                                      (args.completion_min, args.completion_max), args.seed)
        advantages = torch.randn(ids.size(0), generator=torch.Generator().manual_seed(args.seed))
        print(f"model {loaded.model_path} ({loaded.dtype}), batch {tuple(ids.shape)}: {args.prompts} prompts x "
              f"{args.generations}, prompt {args.prompt_length}, completion {args.completion_min}-"
              f"{args.completion_max} of {width}; {args.repeats} repeats, alternating order, after one warm-up each")
        results: dict[bool, list[dict]] = {False: [], True: []}
        for share in (False, True):  # warm-up
            one_pass(trainer, ids, mask, width, share, advantages)
        for r in range(args.repeats):
            for share in ((False, True) if r % 2 == 0 else (True, False)):
                results[share].append(one_pass(trainer, ids, mask, width, share, advantages))
                x = results[share][-1]
                print(f"  repeat {r + 1} {'shared' if share else 'full  '}: forward {x['forward']:.2f} s (cpu "
                      f"{x['cpu forward']:.2f}), backward {x['backward']:.2f} s (cpu {x['cpu backward']:.2f}), "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    names = {False: "full rows", True: "shared prompt"}
    keys = ("forward", "backward", "total", "cpu forward", "cpu backward", "cpu total")
    print("seconds, median / minimum over the repeats (wall; cpu = this process's CPU time):")
    print(f"{'':14} " + " ".join(f"{k:>15}" for k in keys) + f" {'peak RSS +MiB':>14} {'tokens':>7}")
    for share in (False, True):
        rs = results[share]
        cols = [f"{statistics.median([x[k] for x in rs]):6.2f} / {min(x[k] for x in rs):6.2f}" for k in keys]
        peaks = [x["peak_mib"] for x in rs if x["peak_mib"] is not None]
        peak = f"{statistics.median(peaks):.0f}" if peaks else "n/a"
        print(f"{names[share]:14} " + " ".join(f"{c:>15}" for c in cols) + f" {peak:>14} {rs[0]['forwarded']:>7}")
    for key in keys:
        full = [x[key] for x in results[False]]
        shared = [x[key] for x in results[True]]
        print(f"ratio full/shared {key:12}: median {statistics.median(full) / statistics.median(shared):.2f}x, "
              f"minimum {min(full) / min(shared):.2f}x")
    real = mask[:, -width:].bool()
    diff = (results[False][0]["logps"] - results[True][0]["logps"])[real].abs().max().item()
    print(f"max |log-prob diff| on completion tokens, shared vs full rows ({loaded.dtype}): {diff:.2e}; mean "
          f"entropy {results[False][0]['entropy']:.4f} vs {results[True][0]['entropy']:.4f}")
    if loaded.dtype != "float32":  # 16-bit rounding differs between any two kernels: measure both against float32
        from trl.trainer.utils import selective_log_softmax

        from lowmem_grpo.train.shared_prompt import completion_logits

        from lowmem_grpo import backends
        from lowmem_grpo.recipe_io import load_recipe

        # loaded afresh in float32 (a cast copy keeps computing in the dtype its config records); the LoRA
        # initialisation is seeded, so the adapters are equal
        reference = backends.load(load_recipe(str(RECIPE), ["model.dtype=float32"]), "hf").model.train()
        with torch.no_grad():
            logits = completion_logits(reference, ids, mask, width, share=False).logits.float() / trainer.temperature
        truth = selective_log_softmax(logits, ids[:, -width:])
        for share in (False, True):
            err = (results[share][0]["logps"] - truth)[real].abs()
            print(f"  {names[share]} ({loaded.dtype}) vs full rows in float32: max {err.max().item():.2e}, "
                  f"mean {err.mean().item():.2e}")
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
