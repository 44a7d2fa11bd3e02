"""`lowmem-grpo export`: the adapter (lora), or a merged model (merged-16bit, merged-4bit, gguf) proven by its logits
and scored on the held-out problems (docs/runs.md). Written to a hidden folder beside --out and renamed into place at
the end, so an interrupted or failed export leaves nothing at --out."""

from __future__ import annotations

import contextlib
import filecmp
import functools
import gc
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_grpo.backends import locate_model
from lowmem_grpo.backends.adapter import name_original_base
from lowmem_grpo.device import cuda_facts
from lowmem_grpo.errors import BadInputError, LowmemError
from lowmem_grpo.export import gguf_proof, proof
from lowmem_grpo.export.card import write_card
from lowmem_grpo.export.score import record, score_folder
from lowmem_grpo.export.tokenizer_files import repair_byte_level_bpe
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.rundir import layout, telemetry
from lowmem_grpo.rundir.checkpoints import complete_checkpoints, is_complete
from lowmem_grpo.runtime import auto_dtype

log = logging.getLogger(__name__)

FORMATS = ("lora", "merged-16bit", "merged-4bit", "gguf")
DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
PHASES = {
    "lora": ["load", "copy", "verify", "card"],
    "merged-16bit": ["load", "merge", "save", "prove", "score", "card"],
    "merged-4bit": ["load", "merge", "save", "prove", "quantize", "prove-4bit", "score", "card"],
    "gguf": ["load", "merge", "save", "prove", "convert", "prove-gguf", "card"],
}


@dataclass
class ExportResult:
    """What an export wrote and how close it is to the adapter model."""

    out: Path
    format: str
    source: Path
    step: int | None
    dtype: str | None = None
    max_abs_diff: float | None = None
    tolerance: float | None = None
    adapter_effect: float | None = None
    proof_tokens: int = 0
    logit_scale: float = 0.0
    checks: dict[str, float] = field(default_factory=dict)  # each proof's max |logit difference|
    tolerances: dict[str, float] = field(default_factory=dict)  # each proof's bound (`tolerance`: the last one's)
    gguf_type: str | None = None
    gguf_proof: dict[str, Any] = field(default_factory=dict)  # the llama.cpp proof's figures
    score: dict[str, Any] | None = None  # accuracy beside the adapter's (score.summarize); None: not scored
    file: str | None = None  # the model file a user loads (the .gguf); None for folder formats
    size_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Job:
    """What every phase of one export reads."""

    run_dir: Path
    recipe: Any
    base_name: str
    base_path: str
    src: Path
    tokenizer: Any
    dtype: str
    trust: bool
    device: str
    tolerance: float | None
    score: bool
    gguf_type: str = "f16"
    script: Path | None = None


def find_source(run_dir: Path, checkpoint: int | None) -> tuple[Path, int | None]:
    """The adapter folder to export (checkpoint-N, or the final adapter/) and its step."""
    if checkpoint is not None:
        src = run_dir / f"checkpoint-{checkpoint}"
        found = [step for step, _ in complete_checkpoints(run_dir)]
        fix = f"use --checkpoint with one of {found}" if found else "leave out --checkpoint"
        if not (src / "adapter_config.json").exists():
            raise BadInputError(f"{run_dir} has no adapter checkpoint at step {checkpoint}", fix=fix)
        if not is_complete(src):
            raise BadInputError(f"{src} is incomplete (no valid completion marker: its save was interrupted)",
                                fix=fix)
        return src, checkpoint
    src = run_dir / layout.ADAPTER_DIR
    if not (src / "adapter_config.json").exists():
        found = sorted(p.name for p in run_dir.glob("checkpoint-*"))
        raise BadInputError(f"{run_dir} has no final adapter ({layout.ADAPTER_DIR}/): the run did not finish",
                            fix=f"export a checkpoint with --checkpoint STEP ({', '.join(found) or 'none saved yet'})")
    steps = [r["step"] for r in telemetry.read_metrics(run_dir)
             if isinstance(r.get("step"), int) and r.get("stage", "grpo") == "grpo"]  # not the prime stage's steps
    return src, max(steps) if steps else None


def check_out_dir(out: Path, overwrite: bool, protected: list[Path]) -> None:
    """Refuse a non-empty --out without --overwrite, and any --out that holds the run being exported."""
    out = out.resolve()
    for path in protected:
        path = path.resolve()
        if out == path or out in path.parents:
            raise BadInputError(f"--out {out} would replace {path}, which the export reads",
                                fix="choose an --out outside the run directory's adapter and checkpoints")
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} is a file", fix="give a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise BadInputError(f"--out {out} is not empty", fix="pass --overwrite to replace it, or choose another --out")


def _check_request(run_dir: Path, fmt: str, out: Path, dtype: str | None, checkpoint: int | None,
                   overwrite: bool) -> tuple[Path, int | None]:
    """The adapter folder to export and its step, after refusing a bad format, dtype, run directory or --out."""
    if fmt not in FORMATS:
        raise BadInputError(f"unknown export format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise BadInputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}", fix="use float32 or bfloat16")
    if not (run_dir / layout.RECIPE_FILE).exists():
        raise BadInputError(f"{run_dir} is not a run directory (no {layout.RECIPE_FILE})",
                            fix="give the folder `lowmem-grpo train` wrote")
    src, step = find_source(run_dir, checkpoint)
    check_out_dir(out, overwrite, [run_dir / layout.ADAPTER_DIR, run_dir / layout.RECIPE_FILE,
                                   *run_dir.glob(f"{layout.CHECKPOINT_PREFIX}*")])
    return src, step


def _check_tools(fmt: str, gguf_type: str, llama_cpp: str | Path | None, cpu_4bit: bool) -> tuple[Path | None, str]:
    """The GGUF converter (None for other formats) and the device, once what `fmt` needs is there."""
    script = None
    if fmt == "gguf":  # before any model loads: exit 2 without the extra
        script = gguf_proof.check(gguf_type, llama_cpp)
    import torch

    cuda = torch.cuda.is_available()
    if fmt == "merged-4bit" and not (cuda or cpu_4bit):
        raise BadInputError("--format merged-4bit needs a CUDA GPU (bitsandbytes 4-bit serialization); "
                            "none is visible", fix="run the export on a GPU machine, use --format merged-16bit, "
                                                   "or --cpu-4bit (bitsandbytes' CPU backend, slow)")
    if fmt == "merged-4bit" and not importlib.util.find_spec("bitsandbytes"):
        raise BadInputError("--format merged-4bit needs bitsandbytes", fix="pip install bitsandbytes")
    return script, "cuda" if cuda else "cpu"


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    tokenizer.save_pretrained(str(folder))
    repair_byte_level_bpe(folder)


def _free() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def merge_adapter(model: Any) -> Any:
    """The adapter merged into the base weights: PEFT's merge_and_unload."""
    return model.merge_and_unload()


def export(run_dir: str | Path, fmt: str, out: str | Path, *, checkpoint: int | None = None,
           overwrite: bool = False, dtype: str | None = None, tolerance: float | None = None,
           llama_cpp: str | Path | None = None, base: str | None = None, cpu_4bit: bool = False,
           gguf_type: str = "f16", score: bool = True, on_phase: Callable[[str], None] | None = None,
           merge: Callable[[Any], Any] = merge_adapter) -> ExportResult:
    """Export a run's adapter in `fmt` to `out` (module docstring). `cpu_4bit`: merged-4bit on bitsandbytes' CPU
    backend; `score`: answer the held-out problems with a merged export (gguf always does: its proof needs them);
    `on_phase(name)` after each phase (whatever it raises aborts the export, leaving nothing); `merge(peft_model)`
    merges the adapter."""
    started = time.monotonic()
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    src, step = _check_request(run_dir, fmt, out, dtype, checkpoint, overwrite)
    script, device = _check_tools(fmt, gguf_type, llama_cpp, cpu_4bit)
    job = _load_job(run_dir, src, fmt, base, dtype, device=device, tolerance=tolerance, score=score,
                    gguf_type=gguf_type, script=script)
    result = ExportResult(out=out, format=fmt, source=src, step=step, gguf_type=gguf_type if script else None,
                          dtype=None if fmt == "lora" else job.dtype)
    with _progress(fmt, started, on_phase) as done:
        _write(job, result, merge, done)
    result.seconds = time.monotonic() - started
    record(run_dir, result)
    log.info("exported %s (%s) to %s in %.1f s", src, fmt, out, result.seconds)
    return result


def _load_job(run_dir: Path, src: Path, fmt: str, base: str | None, dtype: str | None, **options: Any) -> _Job:
    """The recipe, base model and tokenizer the phases read; a merged export refuses a quantized base here."""
    from transformers import AutoTokenizer

    recipe = load_recipe(str(run_dir / layout.RECIPE_FILE))
    base_name = base or recipe.model.name
    base_path = locate_model(base_name)
    trust = recipe.model.trust_remote_code
    if fmt != "lora":
        proof.check_base_unquantized(base_path, trust)
    where = src if (src / "tokenizer_config.json").exists() else base_path
    tokenizer = AutoTokenizer.from_pretrained(str(where), trust_remote_code=trust)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the tokenizer has no chat template; the export will have none either")
    return _Job(run_dir, recipe, base_name, base_path, src, tokenizer, dtype or auto_dtype(cuda_facts())[0], trust,
                **options)


@contextlib.contextmanager
def _progress(fmt: str, started: float, on_phase: Callable[[str], None] | None) -> Iterator[Callable[[str], None]]:
    """`done(name)`, called after each phase: a progress bar step, then `on_phase`."""
    from tqdm import tqdm

    bar = tqdm(total=len(PHASES[fmt]), desc=f"export {fmt}", unit="phase", disable=None)

    def done(name: str) -> None:
        log.debug("export phase %s done after %.1f s", name, time.monotonic() - started)
        bar.set_postfix_str(name)
        bar.update(1)
        if on_phase:
            on_phase(name)

    try:
        yield done
    finally:
        bar.close()


def _write(job: _Job, result: ExportResult, merge: Callable[[Any], Any], done: Callable[[str], None]) -> None:
    """Every phase into a hidden folder beside result.out, renamed into place only once all of them succeeded."""
    tmp = _partial_dir(result.out)
    try:
        if result.format == "lora":
            done("load")
            _export_lora(job, tmp, done)
        else:
            _export_merged(result.format, job, tmp, result, done, merge)
        write_card(tmp, job.run_dir, job.recipe, result, job.base_name, job.base_path)
        done("card")
        result.size_bytes = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        _publish(tmp, result.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_lora(job: _Job, tmp: Path, done: Callable[[str], None]) -> None:
    src = job.src
    copied = [name for name in ADAPTER_FILES if (src / name).exists()]
    for name in copied:
        shutil.copy2(src / name, tmp / name)
    _save_tokenizer(job.tokenizer, tmp)
    done("copy")
    for name in copied:
        if not filecmp.cmp(src / name, tmp / name, shallow=False):
            raise LowmemError(f"copy of {name} differs from {src / name}", fix="check the disk and run again")
    name_original_base(tmp, job.base_name)  # after the check: the copy is verified byte for byte first
    done("verify")


def _export_merged(fmt: str, job: _Job, tmp: Path, result: ExportResult, done: Callable[[str], None],
                   merge: Callable[[Any], Any]) -> None:
    inputs = proof.proof_inputs(job.tokenizer, job.recipe.data.system_prompt, job.recipe.data.prefill)
    result.proof_tokens = sum(len(ids) for ids in inputs)
    work = tmp / ".merged-16bit" if fmt != "merged-16bit" else tmp
    work.mkdir(exist_ok=True)
    reference = _merge(job, work, inputs, result, done, merge)
    prove = functools.partial(_prove, reference=reference, inputs=inputs, result=result, done=done)
    prove("prove", lambda: proof.load_causal_lm(work, job.dtype, job.device, job.trust),
          None if fmt == "merged-4bit" else job.tolerance, "merged-16bit")
    if fmt == "merged-4bit":
        quantized = proof.load_causal_lm(work, job.dtype, job.device, job.trust, quantize_4bit=True)
        quantized.save_pretrained(str(tmp))
        _save_tokenizer(job.tokenizer, tmp)
        del quantized
        _free()
        done("quantize")
        from peft import PeftModel

        nf4_base = proof.load_causal_lm(job.base_path, job.dtype, job.device, job.trust, True)
        adapter4 = PeftModel.from_pretrained(nf4_base, str(job.src))
        reference4 = proof.logits_on(adapter4.eval(), inputs)  # QLoRA: the adapter over the nf4 base
        del adapter4, nf4_base
        _free()
        prove("prove-4bit", lambda: proof.load_causal_lm(tmp, job.dtype, job.device, job.trust), job.tolerance,
              "merged-4bit", reference=reference4)
    if fmt == "gguf":
        gguf_proof.export_gguf(job, work, tmp, result, done)
    else:
        score_folder(job, tmp, result)
        done("score")
    if work != tmp:
        shutil.rmtree(work)


def _merge(job: _Job, target: Path, inputs: list[list[int]], result: ExportResult, done: Callable[[str], None],
           merge: Callable[[Any], Any]) -> list[Any]:
    """Adapter-model logits (result.adapter_effect set); the merged model saved to `target`. The base is reloaded in
    16 bits (or float32) for Unsloth runs too: merging into its 4-bit base would merge into dequantized nf4 weights."""
    from peft import PeftModel

    base = proof.load_causal_lm(job.base_path, job.dtype, job.device, job.trust)
    model = PeftModel.from_pretrained(base, str(job.src)).eval()
    done("load")
    with model.disable_adapter():
        base_logits = proof.logits_on(model, inputs)
    reference = proof.logits_on(model, inputs)
    result.adapter_effect = proof.max_abs_diff(reference, base_logits)
    merged = merge(model)
    done("merge")
    merged.save_pretrained(str(target))
    _save_tokenizer(job.tokenizer, target)
    if not (target / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(merged.config).save_pretrained(str(target))
    del merged, model, base
    _free()
    done("save")
    log.info("the adapter moves the base model's logits by up to %.3g", result.adapter_effect)
    if result.adapter_effect == 0:
        log.warning("the adapter does not change the model's logits (an untrained adapter?)")
    return reference


def _prove(name: str, load: Callable[[], Any], tolerance: float | None, kind: str, *, reference: list[Any],
           inputs: list[list[int]], result: ExportResult, done: Callable[[str], None]) -> None:
    """Reload with plain transformers and compare logits with `reference`; fail above `tolerance` (default: the
    one for `kind` and the dtype, scaled by the reference logits)."""
    scale = result.logit_scale = proof.logit_scale(reference)
    relative = tolerance is None and kind != "merged-4bit"  # nf4 re-quantizes W + s*B@A: judged absolutely
    if tolerance is None:
        tolerance = proof.tolerance_for(kind, result.dtype or "float32", scale)
    result.tolerance = result.tolerances[name] = tolerance
    try:
        model = load()
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise LowmemError(f"{name}: the exported model does not load with plain transformers: {exc}",
                          fix="see the error above; nothing was written") from exc
    diff = result.max_abs_diff = result.checks[name] = proof.max_abs_diff(reference, proof.logits_on(model, inputs))
    del model
    _free()
    log.info("%s: max |logit diff| vs the adapter model = %.3g (tolerance %.3g, %s, %d tokens, max |logit| %.3g)",
             name, diff, tolerance, result.dtype, result.proof_tokens, scale)
    failure = proof.judge(diff, tolerance, result.adapter_effect or 0.0, relative=relative)
    if failure:
        raise LowmemError(f"{name}: the exported model's logits {failure} ({result.dtype}); nothing was written",
                          fix="export with --dtype float32 for an exact merge, or pass --tolerance if this "
                              "precision's rounding is acceptable")
    done(name)


def _partial_dir(out: Path) -> Path:
    """The hidden folder beside `out` the export is written to, renamed into place only at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the published folder gets normal permissions
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished folder to `out`, replacing what is there only now that everything succeeded."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / "previous")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / "previous", out)
        raise
    shutil.rmtree(old, ignore_errors=True)
