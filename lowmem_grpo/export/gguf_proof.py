"""The proof that a GGUF file is the merged model, run in llama.cpp itself beside the merged model in transformers
(docs/runs.md, GGUF): both answer the held-out problems greedily (score.held_out); any prompt llama.cpp tokenizes
differently fails it; a 16-bit file passes with the same greedy texts or its teacher-forced logits within tolerance
(proof.tolerance_for, proof.ADAPTER_SHARE); a quantized file fails only when it loses significantly more accuracy
than its type's margin (QUANTIZED_MARGINS). The chat template the file carries is compared with the tokenizer's.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import LowmemError
from lowmem_grpo.export import gguf_export, proof, score
from lowmem_grpo.export.gguf_export import QUANTIZED, run_child
from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

LOGIT_SEQUENCES = 3
GGUF_DTYPES = {"f16": "float16", "bf16": "bfloat16"}
CONTEXT_MARGIN = 16
QUANTIZED_MARGINS = {"q8_0": 0.05, "q4_k_m": 0.10}
"""The accuracy (absolute, on the held-out problems) a quantized file may lose against the merged model before its
proof fails; it fails only when the loss beyond the margin is significant: the paired 95% CI of (file - merged) lies
wholly below -margin.

The proof is there to catch a broken file (a wrong tokenizer, a bad conversion: word salad, accuracy collapsing
toward zero), not the greedy flips quantization makes by design: on 100 problems four answers lost and none gained
give -0.040 [-0.080, -0.010], a CI wholly below zero from a sound q8_0 file. Requiring the reverse (a CI wholly above
-margin, proven non-inferiority) would fail sound files on 100 problems, whose CI spans about +-0.05, and every file
on the 8 problems of a run without a stage evaluation. q8_0 (8.5 bits per weight, near-lossless in llama.cpp's own
measurements) is allowed 5 points; q4_k_m (about 5 bits, coarser by design) 10. A collapsed file loses far more than
either. Where the merged model answers fewer than the margin correctly, accuracy cannot show a loss; the prompt-token
check still holds."""
SIXTEEN_BIT_RULE = ("passes with every greedy answer the same text as the merged model's, or with its logits within "
                    "the tolerance")


def first_divergence(tokenizer: Any, ours: str, theirs: str) -> dict[str, Any]:
    """Where two answers part: the token index (transformers' tokenization of both), both tokens, and the text
    before them."""
    a, b = tokenizer.encode(ours, add_special_tokens=False), tokenizer.encode(theirs, add_special_tokens=False)
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    piece = lambda ids: tokenizer.decode(ids[j:j + 1]) if j < len(ids) else "<end>"  # noqa: E731
    return {"token": j, "transformers": piece(a), "llama.cpp": piece(b),
            "before": tokenizer.decode(a[max(0, j - 12):j])}


def _logit_figures(target: Path, merged: Any, sequences: list[list[int]], n_ctx: int) -> dict[str, float]:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="lowmem-logits-") as tmp:
        file = Path(tmp) / "logits.npz"
        run_child({"job": "logits", "model": str(target), "sequences": sequences, "n_ctx": n_ctx,
                   "logits_file": str(file)}, "the llama.cpp logit proof")
        with np.load(file) as saved:
            ours = [saved[f"seq{i}"] for i in range(len(sequences))]
    theirs = [t.numpy() for t in proof.logits_on(merged, sequences)]
    worst, same, total = 0.0, 0, 0
    for a, b in zip(ours, theirs, strict=True):
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return {"max_abs_diff": math.inf, "argmax_agreement": 0.0, "positions": len(a)}
        worst = max(worst, float(np.abs(a - b).max()))
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(a)
    return {"max_abs_diff": worst, "argmax_agreement": same / total, "positions": total,
            "logit_scale": max(float(np.abs(b).max()) for b in theirs)}


def _compare(examples: list[dict[str, Any]], reference: Any, answers: list[dict[str, Any]], tokenizer: Any
             ) -> dict[str, Any]:
    """Prompt tokens and greedy texts of llama.cpp's answers against transformers'."""
    same_prompts = sum(tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"] == g["prompt_ids"]
                       for ex, g in zip(examples, answers))
    texts = [(r["completion"], (ex.get("prefill") or "") + g["text"])
             for ex, r, g in zip(examples, reference.records, answers)]
    differ = [i for i, (a, b) in enumerate(texts) if a != b]
    out: dict[str, Any] = {"problems": len(examples), "same_prompt_tokens": same_prompts,
                           "same_greedy_texts": len(texts) - len(differ)}
    if differ:
        out["first_divergence"] = {"problem": differ[0], **first_divergence(tokenizer, *texts[differ[0]])}
    return out


def judge_quantized(gguf_type: str, merged: list[list[Any]], export: list[list[Any]]
                    ) -> tuple[dict[str, Any], str | None]:
    """The quantized rule on the verdicts of the merged model (transformers) and the file (llama.cpp) on the same
    problems: its figures (the paired difference, the margin, the rule in words) and why it fails, or None."""
    margin = QUANTIZED_MARGINS[gguf_type]
    diff = score.difference(merged, export)
    figures = {"accuracy_difference": diff, "margin": margin,
               "rule": f"fails when the paired 95% CI of its accuracy - the merged model's lies wholly below "
                       f"-{margin:.2f} (QUANTIZED_MARGINS)"}
    if not score.significantly_worse(diff, margin):
        return figures, None
    return figures, (f"its accuracy is significantly more than {margin:.2f} below the merged model's: "
                     f"{diff['diff']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}] (paired 95% CI)")


def _verdict(figures: dict[str, Any], gguf_type: str, tolerance: float | None, effect: float,
             reference: Any, export: list[list[Any]], dtype: str) -> str | None:
    """Why the file fails its proof, or None; the rule and its figures go into `figures`."""
    n = figures["problems"]
    if gguf_type in QUANTIZED:
        rule, failure = judge_quantized(gguf_type, reference.verdicts, export)
        figures.update(rule)
    else:
        figures["rule"] = SIXTEEN_BIT_RULE
    if figures["same_prompt_tokens"] != n:
        return (f"llama.cpp tokenizes {n - figures['same_prompt_tokens']} of {n} prompts differently from the "
                "model's tokenizer")
    if gguf_type in QUANTIZED:
        return failure
    logits = figures["logits"]
    # judged by the less precise of the file's dtype and the export's (the merged model's in transformers)
    judged_as = max(GGUF_DTYPES[gguf_type], dtype, key=("float32", "float16", "bfloat16").index)
    bound = tolerance if tolerance is not None else proof.tolerance_for("gguf", judged_as, logits.get("logit_scale", 0.0))
    figures["tolerance"] = bound
    if figures["same_greedy_texts"] == n:
        return None
    failure = proof.judge(logits["max_abs_diff"], bound, effect, relative=tolerance is None)
    return None if failure is None else f"{n - figures['same_greedy_texts']} of {n} greedy answers differ and " \
                                        f"its logits {failure}"


def prove_gguf(target: Path, gguf_type: str, merged_dir: Path, tokenizer: Any, recipe: Any, dtype: str,
               device: str, trust: bool, adapter_effect: float, tolerance: float | None
               ) -> tuple[dict[str, Any], list[list[Any]]]:
    """Run the proof; returns its figures and llama.cpp's verdicts on the held-out problems (for the score).
    LowmemError when the file fails it or llama.cpp crashes."""
    from lowmem_grpo.sampling.generate import eos_ids  # imports torch

    examples = score.held_out(recipe, tokenizer)
    merged = proof.load_causal_lm(merged_dir, dtype, device, trust)
    reference = score.answer_transformers(merged, tokenizer, examples, recipe, device)
    budget = int(score.settings(recipe, device)["max_new_tokens"])
    longest = max(len(tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]) for ex in examples)
    n_ctx = longest + budget + CONTEXT_MARGIN
    generated = run_child({"job": "generate", "model": str(target), "prompts": [ex["prompt"] for ex in examples],
                           "max_new_tokens": budget, "eos_ids": sorted(eos_ids(merged, tokenizer)),
                           "calculator": bool(recipe.data.calculator), "n_ctx": n_ctx},
                          "the llama.cpp proof")
    answers = generated["generations"]
    figures = _compare(examples, reference, answers, tokenizer)
    figures["llama_cpp_seconds"] = generated["seconds"]
    figures["calculator_results"] = sum(1 for g in answers if g["forced_tokens"])  # answers the calculator wrote into
    figures["chat_template_same"] = generated.get("chat_template") == getattr(tokenizer, "chat_template", None)
    figures["merged_accuracy"] = reference.metrics["strict_accuracy"]
    sequences = [g["prompt_ids"] + g["ids"] for g in answers[:LOGIT_SEQUENCES]]
    figures["logits"] = _logit_figures(target, merged, sequences, n_ctx)
    del merged
    export = score.judged(examples, answers)
    figures["accuracy"] = sum(score.values(export)) / len(export)
    log.info("llama.cpp proof (%s): %d/%d prompts tokenized the same, %d/%d greedy answers the same text, max |logit "
             "diff| %.3g, argmax agreement %.3f; accuracy %.3f (transformers, merged %.3f)", gguf_type,
             figures["same_prompt_tokens"], figures["problems"], figures["same_greedy_texts"], figures["problems"],
             figures["logits"]["max_abs_diff"], figures["logits"]["argmax_agreement"], figures["accuracy"],
             figures["merged_accuracy"])
    failure = _verdict(figures, gguf_type, tolerance, adapter_effect, reference, export, dtype)
    if failure:
        raise LowmemError(f"prove-gguf: the {gguf_type} file fails its proof in llama.cpp: {failure}; nothing was "
                          "written", fix="see the figures above; export f16 or q8_0, or check the converter")
    return figures, export


def export_gguf(job: Any, work: Path, tmp: Path, result: Any, done: Callable[[str], None]) -> None:
    """Convert the merged model in `work` (and quantize it) into `tmp`, prove the file in llama.cpp, and score it
    beside the adapter; `done(phase)` after convert and prove-gguf."""
    kind = job.gguf_type
    sixteen = "bf16" if kind == "bf16" or (kind in QUANTIZED and job.dtype == "bfloat16") else "f16"
    target = tmp / gguf_export.file_name(job.recipe.name, kind)
    converted = target if kind not in QUANTIZED else work / gguf_export.file_name(job.recipe.name, sixteen)
    clock = time.monotonic()
    gguf_export.convert(job.script, work, converted, sixteen)
    result.gguf_proof["convert_seconds"] = time.monotonic() - clock
    if kind in QUANTIZED:
        result.gguf_proof["quantize_seconds"] = gguf_export.quantize(converted, target, kind)
        converted.unlink()
    model, pre = gguf_export.tokenizer_kind(target)
    result.gguf_proof.update({"tokenizer_model": model, "tokenizer_pre": pre, "bytes": target.stat().st_size})
    result.file = target.name
    done("convert")
    figures, verdicts = prove_gguf(target, kind, work, job.tokenizer, job.recipe, job.dtype, job.device, job.trust,
                                   result.adapter_effect or 0.0, job.tolerance)
    result.gguf_proof.update(figures)
    if job.recipe.train.eval.stage.problems:
        reference = score.stage_reference(job.run_dir, len(verdicts), job.src.name == layout.ADAPTER_DIR)
        result.score = score.summarize(verdicts, reference, seed=job.recipe.train.seed)
        log.info("gguf %s: %s", kind, score.line(result.score))
    done("prove-gguf")
