"""GGUF files from a merged export, made by llama.cpp's converter (export.converter) and quantizer (the `gguf` extra)
and proven in llama.cpp beside the merged model in transformers on the held-out problems (docs/runs.md, GGUF). Each
llama.cpp step runs in a child process (llama_runner), so a crash there is an error, not the caller's death."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError, LowmemError
from lowmem_grpo.export import proof, score
from lowmem_grpo.export.converter import INSTALL, find_converter
from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

GGUF_TYPES = ("auto", "f16", "bf16", "f32", "q8_0", "q4_k_m")
"""auto: the converter's outtype of the merged model's precision (merged.GGUF_OUTTYPES: the smallest that keeps the
adapter)."""
QUANTIZED = ("q8_0", "q4_k_m")
GGUF_FILE_TYPES = {"f16": "F16", "bf16": "BF16", "f32": "F32", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
INSTALL_WHY = ("llama-cpp-python 0.3.36, built from source at install, about 4 minutes on 2 cores; "
               "the converter of the same llama.cpp is fetched on first use")
CHILD_TIMEOUT_S = 3600


def check(gguf_type: str, llama_cpp: str | Path | None) -> Path:
    """The converter, after checking the type and that llama-cpp-python is installed (BadInputError otherwise)."""
    if gguf_type not in GGUF_TYPES:
        raise BadInputError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}",
                            fix="leave it out (auto: the precision that keeps the adapter), use f16, bf16 or f32 "
                                "(exact), or q8_0 / q4_k_m (quantized, proven by accuracy)")
    if importlib.util.find_spec("llama_cpp") is None:
        raise BadInputError("--format gguf runs the file in llama.cpp to prove it, and llama-cpp-python is not "
                            "installed", fix=f"install the gguf extra ({INSTALL_WHY}): {INSTALL}")
    return find_converter(llama_cpp)


def _tail(text: str) -> str:
    return "\n".join((text or "").strip().splitlines()[-15:])


def run_child(job: dict[str, Any], what: str) -> dict[str, Any]:
    """Run one llama_runner job in a child process; LowmemError with its stderr tail when it fails or crashes."""
    with tempfile.TemporaryDirectory(prefix="lowmem-llama-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({**job, "result": str(result)}), encoding="utf-8")
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding lowmem_grpo, for the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "lowmem_grpo.export.llama_runner", str(request)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, check=False)
        except subprocess.TimeoutExpired as exc:
            raise LowmemError(f"{what}: llama.cpp did not finish in {CHILD_TIMEOUT_S} s",
                              fix="see the log; nothing was written") from exc
        if done.returncode != 0 or not result.is_file():
            how = f"exit {done.returncode}" if done.returncode >= 0 else f"killed by signal {-done.returncode}"
            raise LowmemError(f"{what}: llama.cpp failed ({how}):\n{_tail(done.stderr or done.stdout)}",
                              fix="see the error above; nothing was written")
        return json.loads(result.read_text(encoding="utf-8"))


def convert(script: Path, merged: Path, target: Path, outtype: str) -> None:
    """convert_hf_to_gguf.py `merged` -> `target` at `outtype` (f16, bf16 or f32), in a child process."""
    cmd = [sys.executable, str(script), str(merged), "--outfile", str(target), "--outtype", outtype]
    log.info("converting to GGUF: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0 or not target.is_file():
        raise LowmemError(f"{script.name} failed (exit {done.returncode}):\n{_tail(done.stderr or done.stdout)}",
                          fix="pass --llama-cpp with the converter of a llama.cpp version that supports this "
                              "architecture; nothing was written")


def tokenizer_kind(path: Path) -> tuple[str | None, str | None]:
    """The GGUF's tokenizer.ggml.model and tokenizer.ggml.pre (what llama.cpp tokenizes with)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
        raise LowmemError(f"{path.name} is not a GGUF file llama.cpp can read: {exc}",
                          fix="pass --llama-cpp with another llama.cpp's converter; nothing was written") from exc
    fields = [reader.get_field(key) for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre")]
    return tuple(None if f is None else bytes(f.parts[f.data[0]]).decode("utf-8") for f in fields)  # type: ignore


LOGIT_SEQUENCES = 3
GGUF_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
OUTTYPES = {dtype: kind for kind, dtype in GGUF_DTYPES.items()}  # the converter's outtype of a merged model's dtype
CONTEXT_MARGIN = 16
QUANTIZED_MARGINS = {"q8_0": 0.05, "q4_k_m": 0.10}
"""Accuracy a quantized file may lose against the merged model: it fails when the paired 95% CI of (file - merged)
lies wholly below -margin. The proof catches a broken file (accuracy collapsing), not the greedy flips quantization
makes by design (four lost of 100 give -0.040 [-0.080, -0.010] from a sound q8_0 file); proven non-inferiority would
fail sound files on 100 problems (CI about +-0.05). q8_0 is near-lossless, q4_k_m coarser by design."""
SIXTEEN_BIT_RULE = ("passes with every greedy answer the same text as the merged model's, or with its logits within "
                    "the tolerance")


def first_divergence(tokenizer: Any, ours: str, theirs: str) -> dict[str, Any]:
    """Where two answers part (transformers' tokenization of both): the token index, both tokens, the text before."""
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


def judge_quantized(gguf_type: str, merged: list[list[Any]], export: list[list[Any]]
                    ) -> tuple[dict[str, Any], str | None]:
    """The quantized rule on the verdicts of the merged model and the file on the same problems: its figures, and
    why it fails or None."""
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
    failure = None
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
    bound = tolerance if tolerance is not None else proof.tolerance_for(judged_as, logits.get("logit_scale", 0.0))
    figures["tolerance"] = bound
    if figures["same_greedy_texts"] == n:
        return None
    failure = proof.judge(logits["max_abs_diff"], bound, effect, relative=tolerance is None)
    return None if failure is None else f"{n - figures['same_greedy_texts']} of {n} greedy answers differ and " \
                                        f"its logits {failure}"


def prove_gguf(target: Path, work: Path, job: Any, adapter_effect: float) -> tuple[dict[str, Any], list[list[Any]]]:
    """Prove `target` against the merged model in `work`; returns the figures and llama.cpp's verdicts on the held-out
    problems. LowmemError when the file fails it or llama.cpp crashes."""
    from lowmem_grpo.sampling.generate import eos_ids  # imports torch

    tokenizer, recipe, gguf_type = job.tokenizer, job.recipe, job.gguf_type
    examples = score.held_out(recipe, tokenizer)
    batch = score.job_batch(job)
    merged = proof.load_causal_lm(work, job.dtype, job.device, job.trust)
    reference = score.answer_transformers(merged, tokenizer, examples, recipe, job.device, batch)
    budget = int(score.settings(recipe, job.device)["max_new_tokens"])
    prompt_ids = [tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"] for ex in examples]
    n_ctx = max(map(len, prompt_ids)) + budget + CONTEXT_MARGIN
    generated = run_child({"job": "generate", "model": str(target), "prompts": [ex["prompt"] for ex in examples],
                           "max_new_tokens": budget, "eos_ids": sorted(eos_ids(merged, tokenizer)),
                           "calculator": bool(recipe.data.calculator), "n_ctx": n_ctx},
                          "the llama.cpp proof")
    answers = generated["generations"]
    texts = [(r["completion"], (ex.get("prefill") or "") + g["text"])
             for ex, r, g in zip(examples, reference.records, answers)]
    differ = [i for i, (a, b) in enumerate(texts) if a != b]
    figures: dict[str, Any] = {"problems": len(examples),
                               "same_prompt_tokens": sum(p == g["prompt_ids"] for p, g in zip(prompt_ids, answers)),
                               "same_greedy_texts": len(texts) - len(differ)}
    if differ:
        figures["first_divergence"] = {"problem": differ[0], **first_divergence(tokenizer, *texts[differ[0]])}
    figures["llama_cpp_seconds"] = generated["seconds"]
    figures["llama_cpp_repack"] = generated["repack"]
    if not generated["repack"]:
        log.warning("llama.cpp proof: this llama.cpp build has AMX kernels, which crash on K-quant files; the file is "
                    "proven with weight repacking off (llama-cli / llama-server --no-repack on this CPU)")
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
    failure = _verdict(figures, gguf_type, job.tolerance, adapter_effect, reference, export, job.dtype)
    if failure:
        raise LowmemError(f"prove-gguf: the {gguf_type} file fails its proof in llama.cpp: {failure}; nothing was "
                          "written", fix="see the figures above; export f16 or q8_0, or check the converter")
    return figures, export


def export_gguf(job: Any, work: Path, tmp: Path, result: Any, done: Callable[[str], None]) -> None:
    """Convert (and quantize) the merged model in `work` into `tmp`, prove the file in llama.cpp, and score it."""
    kind = job.gguf_type
    # A quantized type is quantized from the exact file of the merge's precision, which llama.cpp never runs: only
    # the final file is proven (on a build with AMX kernels, with repacking off: llama_runner.repack_allowed).
    exact = OUTTYPES[job.dtype]
    target = tmp / f"{job.recipe.name}-{GGUF_FILE_TYPES[kind]}.gguf"
    converted = target if kind not in QUANTIZED else work / f"{job.recipe.name}-{GGUF_FILE_TYPES[exact]}.gguf"
    clock = time.monotonic()
    convert(job.script, work, converted, exact)
    result.gguf_proof["convert_seconds"] = time.monotonic() - clock
    if kind in QUANTIZED:
        answer = run_child({"job": "quantize", "src": str(converted), "dst": str(target), "type": kind},
                           f"quantize to {GGUF_FILE_TYPES[kind]}")
        result.gguf_proof["quantize_seconds"] = float(answer["seconds"])
        converted.unlink()
    model, pre = tokenizer_kind(target)
    result.gguf_proof.update({"tokenizer_model": model, "tokenizer_pre": pre, "bytes": target.stat().st_size})
    result.file = target.name
    done("convert")
    figures, verdicts = prove_gguf(target, work, job, result.adapter_effect or 0.0)
    result.gguf_proof.update(figures)
    if job.recipe.train.eval.stage.problems:
        reference = score.stage_reference(job.run_dir, len(verdicts), job.src.name == layout.ADAPTER_DIR)
        result.score = score.summarize(verdicts, reference, seed=job.recipe.train.seed)
        log.info("gguf %s: %s", kind, score.line(result.score))
    done("prove-gguf")
