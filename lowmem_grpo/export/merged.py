"""A merged export's phases: the adapter model and the base in float32 (the exact adapter effect), the precision that
keeps this adapter (precision.py), the merge saved in it, the logit proof, then the score or the GGUF file."""

from __future__ import annotations

import gc
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError, LowmemError
from lowmem_grpo.export import gguf_proof, precision, proof
from lowmem_grpo.export.score import score_folder
from lowmem_grpo.export.tokenizer_files import save_tokenizer

log = logging.getLogger(__name__)

REFERENCE_HEADROOM = 1.25
"""The float32 stage runs on the GPU when its free memory holds the base's float32 weights times this (activations of
the proof's prompts, the LoRA, the allocator), else on the CPU."""


def merge_adapter(model: Any) -> Any:
    """The adapter merged into the base weights: PEFT's merge_and_unload."""
    return model.merge_and_unload()


def reference_device(device: str, params: int, free_bytes: int | None) -> str:
    """Where the float32 stage (adapter model, base, merge, proof) runs: the export's device, unless that is a GPU
    whose free memory does not hold `params` float32 weights with REFERENCE_HEADROOM."""
    if device == "cuda" and free_bytes is not None and params * 4 * REFERENCE_HEADROOM > free_bytes:
        return "cpu"
    return device


def free() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def export_merged(job: Any, tmp: Path, result: Any, done: Callable[[str], None],
                  merge: Callable[[Any], Any]) -> None:
    """Every phase of a merged (or GGUF) export into `tmp`. With the precision chosen (not asked for), an export
    whose logits fail the proof is merged again in the next larger precision that keeps the adapter's change."""
    inputs = proof.proof_inputs(job.tokenizer, job.recipe.data.system_prompt, job.recipe.data.prefill)
    result.proof_tokens = sum(len(ids) for ids in inputs)
    model = load_adapter_model(job)
    done("load")
    reference, base_logits = _reference(model, inputs, result)
    choice, tries = choose_precision(job, model, result)
    for attempt, dtype in enumerate(tries):
        work = tmp / f".merged-{dtype}"
        work.mkdir()
        _save_merged(job, merge(model if attempt == 0 else load_adapter_model(job)), dtype, work)
        model = None
        free()
        if attempt == 0:
            done("merge")
            done("save")
        failure = _prove(job, work, dtype, inputs, reference, base_logits, result)
        if failure is None:
            break
        shutil.rmtree(work)
        if attempt + 1 == len(tries):
            raise LowmemError(f"prove: the exported model's logits ({dtype}) {failure}; nothing was written",
                              fix=_fix(result.format, job.dtype_why))
        choice = _step_up(job, result, choice, tries[attempt + 1], failure)
    done("prove")
    if result.format == "gguf":
        gguf_proof.export_gguf(job, work, tmp, result, done)
    else:
        for path in work.iterdir():
            path.rename(tmp / path.name)
        score_folder(job, tmp, result)
        done("score")
    shutil.rmtree(work)


def load_adapter_model(job: Any) -> Any:
    """The base in float32 with the adapter (PEFT), on the reference device. The base is reloaded unquantized for
    Unsloth runs too: merging into its 4-bit base would merge into dequantized nf4 weights."""
    from peft import PeftModel

    base = proof.load_causal_lm(job.base_path, "float32", job.reference_device, job.trust)
    return PeftModel.from_pretrained(base, str(job.src)).eval()


def _reference(model: Any, inputs: list[list[int]], result: Any) -> tuple[list[Any], list[Any]]:
    """The float32 adapter model's and base's logits on the proof inputs (result.adapter_effect set)."""
    with model.disable_adapter():
        base_logits = proof.logits_on(model, inputs)
    reference = proof.logits_on(model, inputs)
    result.adapter_effect = proof.max_abs_diff(reference, base_logits)
    result.logit_scale = proof.logit_scale(reference)
    log.info("the adapter moves the base model's logits by up to %.3g (float32)", result.adapter_effect)
    if result.adapter_effect == 0:
        log.warning("the adapter does not change the model's logits (an untrained adapter?)")
    return reference, base_logits


def _save_merged(job: Any, merged: Any, dtype: str, target: Path) -> None:
    """The merged float32 model saved to `target` in `dtype` (each weight rounded once), with tokenizer and
    generation config."""
    import torch

    merged.to(getattr(torch, dtype))
    merged.save_pretrained(str(target))
    save_tokenizer(job.tokenizer, target)
    if not (target / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(merged.config).save_pretrained(str(target))


def choose_precision(job: Any, model: Any, result: Any) -> tuple[precision.Choice, list[str]]:
    """Measure what each precision keeps of the adapter's change (precision.measure), set job.dtype, and return the
    choice and the precisions to try in order: the one asked for, else the smallest the format allows that keeps the
    change and the larger ones that keep it too. BadInputError for merged-16bit when neither 16-bit precision keeps
    it."""
    allowed = precision.SIXTEEN_BIT if result.format == "merged-16bit" else precision.CANDIDATES
    measured = precision.measure(precision.lora_deltas(model), allowed)
    for keeping in measured.values():
        log.info("precision: %s", keeping.line())
    if job.dtype is not None:
        choice = precision.Choice(job.dtype, job.dtype_why, measured)
        tries = [job.dtype]
        if not measured[job.dtype].keeps:
            log.warning("%s was asked for and does not keep this adapter's change on the weights (%s); the logit "
                        "proof judges", job.dtype, measured[job.dtype].line())
    else:
        choice = precision.choose(measured, allowed)
        if choice is None and result.format == "merged-16bit":
            raise BadInputError("no 16-bit precision keeps this adapter's change to the weights: "
                                + "; ".join(k.line() for k in measured.values()),
                                fix="export --format merged (the precision that keeps it, float32 here: twice the "
                                    "size) or --format lora (the adapter beside its base)")
        choice = choice or precision.Choice("float32", "no smaller precision keeps this adapter's change", measured)
        tries = [d for d in allowed[allowed.index(choice.dtype):] if measured[d].keeps] or [choice.dtype]
    _set_precision(job, result, choice)
    return choice, tries


def _set_precision(job: Any, result: Any, choice: precision.Choice) -> None:
    job.dtype = choice.dtype
    if result.format == "gguf" and job.gguf_type in ("auto", *gguf_proof.GGUF_DTYPES):
        job.gguf_type = gguf_proof.OUTTYPES[job.dtype]
        result.gguf_type = job.gguf_type
    result.dtype = choice.dtype
    result.precision = choice.to_dict()
    log.info("precision of the export: %s: %s", choice.dtype, choice.reason)


def _fix(fmt: str, asked: str) -> str:
    """What to do when the last precision tried fails its proof."""
    publish = "; --tolerance publishes it anyway, marked as such in its card"
    if asked:
        return f"leave out {asked.removeprefix('asked for with ')} (the export then picks the precision that keeps " \
               f"the adapter), or export in float32 (exact){publish}"
    if fmt == "merged-16bit":
        return f"export --format merged (float32 where no 16-bit precision keeps it) or --format lora{publish}"
    return "the export does not reproduce the adapter model even in float32: check the base model (--base) and the " \
           "adapter; --format lora exports the adapter itself"


def _step_up(job: Any, result: Any, choice: precision.Choice, larger: str, failure: str) -> precision.Choice:
    """The chosen precision kept the weights' change within the bound but its logits failed the proof: the next."""
    log.warning("%s keeps the adapter's change to the weights within the bound, but its logits %s: merging again in "
                "%s", choice.dtype, failure, larger)
    error = result.effect.get("error", float("nan"))
    reason = (f"{choice.reason}; {choice.dtype}'s logits failed the proof (error {error:.3f} of the adapter's effect, "
              f"at most {proof.MAX_EFFECT_ERROR:.2f}), so the next precision that keeps it")
    stepped = precision.Choice(larger, reason, choice.measured)
    _set_precision(job, result, stepped)
    return stepped


def _prove(job: Any, work: Path, dtype: str, inputs: list[list[int]], reference: list[Any],
           base_logits: list[Any], result: Any) -> str | None:
    """Reload the export with plain transformers and compare its logits with the float32 adapter model's: within the
    tolerance (proof.TOLERANCES for the dtype, or --tolerance), and carrying the adapter's effect
    (proof.MAX_EFFECT_ERROR). Returns why it fails (None when it passes). An explicit --tolerance publishes an export
    whose effect fails, with a warning in the log and the card."""
    device = job.reference_device
    tolerance = job.tolerance if job.tolerance is not None else proof.tolerance_for(dtype, result.logit_scale)
    result.tolerance = tolerance
    try:
        model = proof.load_causal_lm(work, dtype, device, job.trust)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise LowmemError(f"prove: the exported model does not load with plain transformers: {exc}",
                          fix="see the error above; nothing was written") from exc
    exported = proof.logits_on(model, inputs)
    del model
    free()
    if dtype == "float32":
        export_base = base_logits
    else:  # the base's own rounding in this dtype, which the export carries too
        base = proof.load_causal_lm(job.base_path, dtype, device, job.trust)
        export_base = proof.logits_on(base, inputs)
        del base
        free()
    diff = result.max_abs_diff = result.checks["prove"] = proof.max_abs_diff(reference, exported)
    result.effect = {**proof.effect_figures(exported, export_base, reference, base_logits),
                     "max_error": proof.MAX_EFFECT_ERROR}
    log.info("prove: max |logit diff| vs the float32 adapter model %.3g (tolerance %.3g, %s, %d tokens, max |logit| "
             "%.3g); the adapter's effect kept %.1f%%, error %.3f of it (at most %.2f)", diff, tolerance, dtype,
             result.proof_tokens, result.logit_scale, 100 * result.effect["kept"], result.effect["error"],
             proof.MAX_EFFECT_ERROR)
    if not diff <= tolerance:
        return f"differ from the adapter model's by {diff:.3g}, above the tolerance {tolerance:.3g}"
    failure = proof.judge_effect(result.effect)
    if failure and job.tolerance is None:
        return failure
    if failure:
        warning = (f"the logits of this {dtype} export {failure}. It was published because --tolerance "
                   f"{tolerance:.3g} was given")
        result.warnings.append(warning)
        log.warning("prove: %s", warning)
    return None
