"""`lowmem-grpo export`: the adapter (lora), or a merged model (merged, merged-16bit, gguf) in the precision that keeps
the adapter, proven by its logits and scored on the held-out problems (docs/runs.md). Written to a hidden folder beside
--out and renamed into place at the end, so an interrupted or failed export leaves nothing at --out."""

from __future__ import annotations

import contextlib
import filecmp
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
from lowmem_grpo.export import gguf_proof, merged, precision, proof
from lowmem_grpo.export.card import write_card
from lowmem_grpo.export.score import record
from lowmem_grpo.export.tokenizer_files import save_tokenizer
from lowmem_grpo.memory.arch import load_architecture
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.rundir import layout, telemetry
from lowmem_grpo.rundir.checkpoints import complete_checkpoints, is_complete

log = logging.getLogger(__name__)

FORMATS = ("merged", "merged-16bit", "lora", "gguf")
RETIRED = {"merged-4bit": "--format merged-4bit is retired: no measurement showed its bitsandbytes 4-bit folder "
                          "serving a use that merged-16bit (bitsandbytes quantizes it as it loads) or GGUF's 4-bit "
                          "files (llama.cpp, Ollama) do not"}
DTYPES = precision.CANDIDATES
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
PHASES = {
    "lora": ["load", "copy", "verify", "card"],
    "merged": ["load", "merge", "save", "prove", "score", "card"],
    "merged-16bit": ["load", "merge", "save", "prove", "score", "card"],
    "gguf": ["load", "merge", "save", "prove", "convert", "prove-gguf", "card"],
}


@dataclass
class ExportResult:
    """What an export wrote and how close it is to the adapter model."""

    out: Path
    format: str
    source: Path
    step: int | None
    dtype: str | None = None  # the merged weights' precision
    precision: dict[str, Any] = field(default_factory=dict)  # why that one, what each keeps (precision.Choice)
    max_abs_diff: float | None = None
    tolerance: float | None = None
    adapter_effect: float | None = None  # max |adapter - base logits|, float32
    effect: dict[str, float] = field(default_factory=dict)  # how the logits carry it (proof.effect_figures)
    warnings: list[str] = field(default_factory=list)  # what a flag published despite the proof, for the card
    proof_tokens: int = 0
    logit_scale: float = 0.0
    checks: dict[str, float] = field(default_factory=dict)  # each proof's max |logit difference|
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
    dtype: str | None  # asked for; None until the measurement chooses (merged.choose_precision)
    dtype_why: str
    trust: bool
    device: str  # where the export is scored: cuda or cpu
    reference_device: str  # where the float32 stage and the proof run (merged.reference_device)
    tolerance: float | None
    score: bool
    gguf_type: str = "auto"
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
            raise BadInputError(f"{src} is incomplete (no valid completion marker: its save was interrupted)", fix=fix)
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
    if fmt in RETIRED:
        raise BadInputError(RETIRED[fmt], fix="export --format merged-16bit, or --format gguf --gguf-type q4_k_m "
                                              "for a 4-bit file")
    if fmt not in FORMATS:
        raise BadInputError(f"unknown export format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise BadInputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}",
                            fix="leave it out (the export picks the precision that keeps the adapter), or use one "
                                f"of {', '.join(DTYPES)}")
    if fmt == "merged-16bit" and dtype == "float32":
        raise BadInputError("--format merged-16bit holds 16-bit weights, not float32",
                            fix="export --format merged --dtype float32")
    if not (run_dir / layout.RECIPE_FILE).exists():
        raise BadInputError(f"{run_dir} is not a run directory (no {layout.RECIPE_FILE})",
                            fix="give the folder `lowmem-grpo train` wrote")
    src, step = find_source(run_dir, checkpoint)
    check_out_dir(out, overwrite, [run_dir / layout.ADAPTER_DIR, run_dir / layout.RECIPE_FILE,
                                   *run_dir.glob(f"{layout.CHECKPOINT_PREFIX}*")])
    return src, step


def asked_dtype(fmt: str, dtype: str | None, gguf_type: str) -> tuple[str | None, str]:
    """The precision the request fixes, and how: --dtype, or an exact --gguf-type (f16, bf16, f32); (None, "") when
    the export chooses."""
    implied = gguf_proof.GGUF_DTYPES.get(gguf_type) if fmt == "gguf" else None
    if implied and dtype and dtype != implied:
        raise BadInputError(f"--gguf-type {gguf_type} holds {implied} weights, and --dtype {dtype} was given",
                            fix="leave out --dtype, or choose the --gguf-type of that precision")
    if implied:
        return implied, f"asked for with --gguf-type {gguf_type}"
    return dtype, f"asked for with --dtype {dtype}" if dtype else ""


def _check_tools(fmt: str, gguf_type: str, llama_cpp: str | Path | None) -> tuple[Path | None, str]:
    """The GGUF converter (None for other formats) and the device, once what `fmt` needs is there."""
    script = None
    if fmt == "gguf":  # before any model loads: exit 2 without the extra
        script = gguf_proof.check(gguf_type, llama_cpp)
    import torch

    return script, "cuda" if torch.cuda.is_available() else "cpu"


def export(run_dir: str | Path, fmt: str, out: str | Path, *, checkpoint: int | None = None,
           overwrite: bool = False, dtype: str | None = None, tolerance: float | None = None,
           llama_cpp: str | Path | None = None, base: str | None = None, gguf_type: str = "auto",
           score: bool = True, on_phase: Callable[[str], None] | None = None,
           merge: Callable[[Any], Any] = merged.merge_adapter) -> ExportResult:
    """Export a run's adapter in `fmt` to `out` (module docstring). `dtype`: the merged weights' precision (None: the
    smallest that keeps this adapter, precision.py); `score`: answer the held-out problems with a merged export (gguf
    always does: its proof needs them); `on_phase(name)` after each phase (whatever it raises aborts the export,
    leaving nothing); `merge(peft_model)` merges the adapter."""
    started = time.monotonic()
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    src, step = _check_request(run_dir, fmt, out, dtype, checkpoint, overwrite)
    fixed, why = asked_dtype(fmt, dtype, gguf_type)
    script, device = _check_tools(fmt, gguf_type, llama_cpp)
    job = _load_job(run_dir, src, fmt, base, fixed, dtype_why=why, device=device, tolerance=tolerance, score=score,
                    gguf_type=gguf_type, script=script)
    result = ExportResult(out=out, format=fmt, source=src, step=step, gguf_type=gguf_type if script else None)
    with _progress(fmt, started, on_phase) as done:
        _write(job, result, merge, done)
    result.seconds = time.monotonic() - started
    record(run_dir, result)
    log.info("exported %s (%s%s) to %s in %.1f s", src, fmt, f", {result.dtype}" if result.dtype else "", out,
             result.seconds)
    return result


def _load_job(run_dir: Path, src: Path, fmt: str, base: str | None, dtype: str | None, **options: Any) -> _Job:
    """The recipe, base model and tokenizer the phases read; a merged export refuses a quantized base here."""
    from transformers import AutoTokenizer

    recipe = load_recipe(str(run_dir / layout.RECIPE_FILE))
    base_name = base or recipe.model.name
    base_path = locate_model(base_name)
    trust = recipe.model.trust_remote_code
    where_float32 = options["device"]
    if fmt != "lora":
        proof.check_base_unquantized(base_path, trust)
        if where_float32 == "cuda":
            params = load_architecture(base_path, allow_hub=False).total_params()
            where_float32 = merged.reference_device("cuda", params, cuda_facts().free_bytes)
    where = src if (src / "tokenizer_config.json").exists() else base_path
    tokenizer = AutoTokenizer.from_pretrained(str(where), trust_remote_code=trust)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the tokenizer has no chat template; the export will have none either")
    return _Job(run_dir, recipe, base_name, base_path, src, tokenizer, dtype, trust=trust,
                reference_device=where_float32, **options)


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
            merged.export_merged(job, tmp, result, done, merge)
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
    save_tokenizer(job.tokenizer, tmp)
    done("copy")
    for name in copied:
        if not filecmp.cmp(src / name, tmp / name, shallow=False):
            raise LowmemError(f"copy of {name} differs from {src / name}", fix="check the disk and run again")
    name_original_base(tmp, job.base_name)  # after the check: the copy is verified byte for byte first
    done("verify")


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
