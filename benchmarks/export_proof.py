"""What each precision keeps of a run's adapter scaled down, and what the default export makes of it.

    python benchmarks/export_proof.py RUN_DIR                                 # s = 1, 0.3, 0.1, 0.02; merged
    python benchmarks/export_proof.py RUN_DIR --scales 1 0.1 --formats merged merged-16bit gguf

For each scale s the run is copied (without its checkpoints) to a temporary folder with every LoRA B matrix times s:
the same directions, a smaller change, as a lower learning rate gives. Per precision: the share of the weight change
a merge in it keeps and its error (lowmem_grpo.export.precision, measured as the export does), and how the logits of
a merge in it carry the adapter's float32 effect on the proof's prompts (error of the effect; the proof allows
proof.MAX_EFFECT_ERROR). Then each format's default export (no --dtype, no --tolerance): the precision it chose,
its proof, its size; the unscaled one is scored on the run's held-out problems, paired with the adapter's answers
(the run's stage evaluation's, or, for a run without one, the float32 adapter model's on the first --problems).
"""

from __future__ import annotations

import argparse
import copy
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scaled_copy(run_dir: Path, scale: float, target: Path) -> Path:
    """The run without its checkpoints, its final adapter's LoRA B matrices times `scale`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns("checkpoint-*"))
    path = target / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v * scale if "lora_B" in k else v for k, v in tensors.items()}, str(path))
    return target


def with_adapter_answers(run: Path, problems: int) -> None:
    """Give a run without a stage evaluation the adapter's greedy answers on its first `problems` held-out problems
    (the float32 adapter model, the stage evaluation's settings), where the export's score looks for them."""
    import json

    import yaml
    from peft import PeftModel
    from transformers import AutoTokenizer

    from lowmem_grpo.backends import locate_model
    from lowmem_grpo.export import proof, score
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rundir import layout

    if (run / layout.STAGE_EVAL_FILE).is_file():
        return
    raw = yaml.safe_load((run / layout.RECIPE_FILE).read_text())
    raw["train"]["eval"]["stage"]["problems"] = problems
    (run / layout.RECIPE_FILE).write_text(yaml.safe_dump(raw, sort_keys=False))
    recipe = load_recipe(str(run / layout.RECIPE_FILE))
    base_path = locate_model(recipe.model.name)
    tokenizer = AutoTokenizer.from_pretrained(str(run / "adapter"))
    model = PeftModel.from_pretrained(proof.load_causal_lm(base_path, "float32", "cpu"), str(run / "adapter")).eval()
    answers = score.answer_transformers(model, tokenizer, score.held_out(recipe, tokenizer), recipe, "cpu")
    saved = {"verdicts": {"trained": [[v.__dict__ for v in p] for p in answers.verdicts]}}
    (run / layout.STAGE_EVAL_FILE).write_text(json.dumps(saved))


def ties(model) -> float:
    """The share of the merged layers' float32 base weights that sit exactly halfway between two bfloat16 values,
    where any change, however small, rounds a half step its way."""
    import torch

    from lowmem_grpo.export import precision

    on, total = 0, 0
    for _, weight, _ in precision.lora_deltas(model):
        on += int(((weight.view(torch.int32) & 0xFFFF) == 0x8000).sum())
        total += weight.numel()
    return on / total


def per_precision(run: Path) -> tuple[float, dict[str, dict[str, float]]]:
    """The share of base weights on bfloat16 ties, and per dtype: the weights' kept share, error and worst layer
    (precision.measure) and the logits' effect figures of a merge rounded once to it, against the float32 adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from lowmem_grpo.backends import locate_model
    from lowmem_grpo.export import precision, proof
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(str(run / "recipe.yaml"))
    base_path = locate_model(recipe.model.name)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    inputs = proof.proof_inputs(tokenizer, recipe.data.system_prompt, recipe.data.prefill)
    model = PeftModel.from_pretrained(proof.load_causal_lm(base_path, "float32", "cpu"), str(run / "adapter")).eval()
    measured, on_ties = precision.measure(precision.lora_deltas(model)), ties(model)
    with model.disable_adapter():
        base = proof.logits_on(model, inputs)
    reference = proof.logits_on(model, inputs)
    merged = model.merge_and_unload()
    rows = {}
    for dtype, keeping in measured.items():
        kind = getattr(torch, dtype)
        exported = proof.logits_on(copy.deepcopy(merged).to(kind), inputs)
        export_base = proof.logits_on(proof.load_causal_lm(base_path, dtype, "cpu"), inputs)
        rows[dtype] = {**keeping.to_dict(),
                       **{f"logit_{k}": v for k, v in proof.effect_figures(exported, export_base, reference,
                                                                            base).items()}}
    return on_ties, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--scales", nargs="+", type=float, default=[1.0, 0.3, 0.1, 0.02])
    parser.add_argument("--formats", nargs="+", default=["merged"])
    parser.add_argument("--problems", type=int, default=100,
                        help="held-out problems to score on, for a run without a stage evaluation")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export.formats import export
    from lowmem_grpo.export.proof import MAX_EFFECT_ERROR
    from lowmem_grpo.export.score import line

    scratch = Path(tempfile.mkdtemp(prefix="export-bench-"))
    try:
        print(f"precision: weights kept (projection) / worst layer / error of the change; logits: error of the "
              f"adapter's float32 effect (the proof allows {MAX_EFFECT_ERROR})")
        print(f"{'s':>5} {'dtype':<9} {'kept':>7} {'worst':>7} {'error':>7} {'keeps':>6} {'logit err':>9}")
        runs = {}
        for s in args.scales:
            runs[s] = run = scaled_copy(args.run_dir, s, scratch / f"s{s:g}")
            on_ties, rows = per_precision(run)
            for dtype, r in rows.items():
                print(f"{s:>5g} {dtype:<9} {r['kept']:>7.1%} {r['worst_kept']:>7.1%} {r['error']:>7.3f} "
                      f"{'yes' if r['keeps'] else 'no':>6} {r['logit_error']:>9.3f}", flush=True)
        print(f"{on_ties:.1%} of the merged layers' float32 base weights sit on bfloat16 rounding ties")
        print(f"\n{'s':>5} {'format':<13} {'outcome':<8} {'dtype':<9} {'logit err':>9} {'MiB':>5} {'wall s':>6}  score")
        if 1.0 in runs:
            with_adapter_answers(runs[1.0], args.problems)
        for s, run in runs.items():
            for fmt in args.formats:
                out, started = scratch / f"out-{s:g}-{fmt}", time.monotonic()
                try:
                    r = export(run, fmt, out, score=s == 1.0)
                except LowmemError as exc:
                    print(f"{s:>5g} {fmt:<13} {'refused':<8} {str(exc)[:150]}", flush=True)
                    continue
                told = line(r.score) if r.score else "-"
                print(f"{s:>5g} {fmt:<13} {'passed':<8} {r.dtype:<9} {r.effect.get('error', float('nan')):>9.3f} "
                      f"{r.size_bytes / 2**20:>5.0f} {time.monotonic() - started:>6.0f}  {told}", flush=True)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
