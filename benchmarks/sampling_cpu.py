"""GRPO sampling on CPU, before vs after, in one process: tokens/s of TRL's generation from the CPU default's trainer.

    OMP_NUM_THREADS=2 python benchmarks/sampling_cpu.py --dtypes auto --rows 32 --tokens 48 --repeats 3
    OMP_NUM_THREADS=2 python benchmarks/sampling_cpu.py --dtypes float32 --repeats 2 --profile

The CPU default (recipes/smollm2_135m_arith_cpu.py: SmolLM2-135M, LoRA r 16 on all seven projections,
temperature, dtype) builds its trainer exactly as train() does (trainer_factory); its LoRA B is drawn at random
(seeded), so the adapter moves the outputs as a primed one does. Then, per repeat, in alternating order, each
configuration samples the same `--rows` completions (`--rows / group` training prompts x `group`) of up to
`--tokens` tokens through the trainer's own `_generate_single_turn`, from the same seed:
  unmerged        PEFT's unmerged LoRA layers, transformers' sdpa (what sampling ran before)
  merged          the adapter merged into the weights (train.merged_sampling)
  merged+grouped  and grouped-query attention without copying the key/value heads (the default now)
Printed per configuration: completion tokens, wall and CPU seconds and tokens/s of each repeat, the best and the
median, and the ratio of tokens/s to `unmerged` (of the best wall times: load on shared cores only ever adds time;
of the medians; of the best CPU times, which waiting for a shared core does not inflate); how many completions
(rows, and tokens position by position) equal unmerged's (greedy with --greedy; else sampled from the same seed),
the merged copy's size, the load average.
Rows stop at EOS as in training (tokens/s counts the completion tokens TRL keeps, EOS included); the decode
steps run until the last row ends, so the table prints each configuration's longest completion too.
In bfloat16 the merged weights round differently from PEFT's unmerged layers: the last table compares each
configuration's logits (every prompt position) with the same model in float32, unmerged.
--profile: torch.profiler's top operators (self CPU) of one more sampling pass per configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")
CONFIGS = {"unmerged": (False, False), "merged": (True, False), "merged+grouped": (True, True)}


def build(dtype: str, rows: int, tokens: int, group: int, greedy: bool, run_dir: str) -> tuple[Any, Any]:
    """(trainer, prompt token ids) of the CPU default, as train() builds them, with a moved LoRA adapter."""
    import torch
    from datasets import Dataset

    from lowmem_grpo.backends import load, start
    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe import resolved_rewards
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rewards import get_reward

    recipe = load_recipe(RECIPE, [f"model.dtype={dtype}", f"output.dir={run_dir}", f"train.num_generations={group}",
                                  f"train.per_device_train_batch_size={rows}", f"train.max_completion_length={tokens}"])
    loaded = load(recipe, start(recipe, Launch())[0])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    examples = recipe_examples(load_train_rows(recipe.data), loaded.tokenizer, recipe.data)
    from lowmem_grpo.train.grpo import trainer_factory

    weights = resolved_rewards(recipe)
    trainer = trainer_factory(loaded, Dataset.from_list(examples), Path(run_dir), [get_reward(n) for n in weights],
                              list(weights.values()), [])(recipe)
    if greedy:
        trainer.generation_config.do_sample = False
        trainer.generation_kwargs["do_sample"] = False
    trainer.model.train()  # TRL samples with the model in training mode
    prompts = [ex["prompt"] for ex in examples[:rows // group] for _ in range(group)]
    return trainer, loaded.tokenizer(text=prompts)["input_ids"]


def sample(trainer: Any, prompt_ids: list[list[int]], group: int, merged: bool, grouped: bool,
           seed: int = 0) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, CPU seconds (this process, all its threads) and completion ids of one pass of TRL's generation
    with the given configuration."""
    import torch

    trainer.lowmem_merged_sampling, trainer.lowmem_cpu_attention = merged, grouped
    torch.manual_seed(seed)
    started, cpu = time.perf_counter(), time.process_time()
    completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, group)
    return time.perf_counter() - started, time.process_time() - cpu, [list(map(int, c)) for c in completions]


def merged_copy_bytes(model: Any) -> int:
    """Bytes of the merged weights that exist while sampling: one copy of every adapted base weight."""
    from peft.tuners.lora import Linear

    return sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size() for m in model.modules()
               if isinstance(m, Linear))


def float32_copy(model: Any) -> Any:
    """The same base model loaded afresh in float32 with the same adapter weights (a deepcopy converted with
    .float() still computed in the original's dtype here)."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.float32)
    reference = get_peft_model(base, model.peft_config["default"])
    set_peft_model_state_dict(reference, get_peft_model_state_dict(model))
    return reference.eval()


def logit_errors(trainer: Any, prompt_ids: list[list[int]]) -> str:
    """Each configuration's logits at every prompt position against the same model in float32, unmerged."""
    import torch

    from lowmem_grpo.sampling.generate import fast_sampling

    width = max(len(ids) for ids in prompt_ids)
    pad = trainer.processing_class.pad_token_id
    batch = {"input_ids": torch.tensor([[pad] * (width - len(i)) + i for i in prompt_ids]),
             "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in prompt_ids])}
    keep = batch["attention_mask"].bool()
    model = trainer.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ref = float32_copy(model)(**batch).logits[keep]
        assert ref.dtype == torch.float32, ref.dtype
        lines = [f"{'logits vs float32':17s} {'max |diff|':>10s} {'mean |diff|':>11s} {'argmax agrees':>13s}\n"]
        for name, (merged, grouped) in CONFIGS.items():
            with fast_sampling(model, merged, grouped):
                logits = model(**batch).logits[keep].float()
            diff = (logits - ref).abs()
            agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            lines.append(f"{name:17s} {diff.max().item():10.4f} {diff.mean().item():11.5f} {agree:13.4f}\n")
    model.train(was_training)
    return "".join(lines)


def profile(trainer: Any, prompt_ids: list[list[int]], group: int, merged: bool, grouped: bool, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        sample(trainer, prompt_ids, group, merged, grouped)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_dtype(dtype: str, args: argparse.Namespace) -> None:
    import tempfile

    import torch

    with tempfile.TemporaryDirectory(prefix="sampling-bench-") as run_dir:
        trainer, prompt_ids = build(dtype, args.rows, args.tokens, args.group, args.greedy, run_dir)
        model_dtype = next(p.dtype for p in trainer.model.parameters() if not p.requires_grad)
        out = sys.stdout
        out.write(f"\n== dtype {dtype} -> {model_dtype}, {args.rows} rows x up to {args.tokens} tokens, "
                  f"{'greedy' if args.greedy else f'temperature {trainer.temperature}'}, "
                  f"torch threads {torch.get_num_threads()}, merged copy {merged_copy_bytes(trainer.model) / 2**20:.0f} MiB\n")
        sample(trainer, prompt_ids, args.group, False, False)  # warm-up: allocator, first-call paths
        times: dict[str, list[float]] = {name: [] for name in CONFIGS}
        cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
        tokens: dict[str, int] = {}
        longest: dict[str, int] = {}
        texts: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                seconds, cpu_seconds, completions = sample(trainer, prompt_ids, args.group, *CONFIGS[name])
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                tokens[name] = sum(len(c) for c in completions)
                longest[name] = max(len(c) for c in completions)
                texts[name] = completions
                out.write(f"  repeat {r + 1} {name:15s} {seconds:7.2f} s  {tokens[name] / seconds:6.1f} tok/s  "
                          f"CPU {cpu_seconds:7.2f} s  {tokens[name] / cpu_seconds:6.1f} tok/CPU-s\n")
                out.flush()
        base = texts["unmerged"]
        out.write(f"{'configuration':15s} {'tokens':>6s} {'steps':>5s} {'best s':>7s} {'median s':>8s} {'tok/s best':>10s} "
                  f"{'x best':>6s} {'x median':>8s} {'best CPU s':>10s} {'x CPU':>6s}  same completions as unmerged\n")

        def ratio(name: str, pick: Any, series: dict[str, list[float]]) -> float:
            return (tokens[name] / pick(series[name])) / (tokens["unmerged"] / pick(series["unmerged"]))

        for name in CONFIGS:
            same = sum(a == b for a, b in zip(texts[name], base))
            agree = sum(x == y for a, b in zip(texts[name], base) for x, y in zip(a, b))
            out.write(f"{name:15s} {tokens[name]:6d} {longest[name]:5d} {min(times[name]):7.2f} {statistics.median(times[name]):8.2f} "
                      f"{tokens[name] / min(times[name]):10.1f} {ratio(name, min, times):6.2f} "
                      f"{ratio(name, statistics.median, times):8.2f} {min(cpu[name]):10.2f} {ratio(name, min, cpu):6.2f}"
                      f"  {same}/{len(base)} rows, {agree}/{sum(len(b) for b in base)} tokens\n")
        if model_dtype != torch.float32:
            out.write(logit_errors(trainer, prompt_ids[::args.group]))
        if args.profile:
            for name in ("unmerged", "merged+grouped"):
                out.write(f"\n-- profile {name} (one pass, self CPU) --\n")
                out.write(profile(trainer, prompt_ids, args.group, *CONFIGS[name], args.profile_rows) + "\n")
        out.write(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="auto", help="comma-separated model.dtype values (auto, bfloat16, float32)")
    parser.add_argument("--rows", type=int, default=32, help="completions sampled at once (default 32)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per completion (default 48)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy", action="store_true", help="greedy instead of the recipe's temperature")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    parser.add_argument("--profile-rows", type=int, default=15)
    args = parser.parse_args(argv)
    if args.rows % args.group:
        parser.error("--rows must be a multiple of --group")
    logging.basicConfig(level=logging.WARNING)
    for dtype in args.dtypes.split(","):
        run_dtype(dtype.strip(), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
