"""The GRPO memory planner: `plan(recipe, budget_bytes)`, the predicted peak GPU memory of a recipe (docs/memory.md):
the static terms + the largest of the generation, training and evaluation phases (they never hold their transient
memory at once) + the allocator's slack on that phase."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.memory import logprob as ml
from lowmem_grpo.memory import sharing as ms
from lowmem_grpo.memory import terms as mt
from lowmem_grpo.memory.arch import Architecture, load_architecture
from lowmem_grpo.memory.terms import GIB, MIB, Settings
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.distributed import Launch
from lowmem_grpo.runtime import EVAL_BATCH, GPU_PLAN, optimizer_for, place


# name -> (function, phase, where it shows: "allocated" by torch, "device" only)
TERMS = {
    "base_weights": (mt.base_weights, "static", "allocated"),
    "lora_params": (mt.lora_params, "static", "allocated"),
    "optimizer_state": (mt.optimizer_state, "static", "allocated"),
    "batch_buffers": (mt.batch_buffers, "static", "allocated"),
    "reference_model": (mt.reference_model, "static", "allocated"),
    "vllm_reservation": (mt.vllm_reservation, "static", "device"),
    "cuda_context": (mt.cuda_context, "static", "device"),
    "kv_cache": (mt.kv_cache, "generation", "allocated"),
    "generation_workspace": (mt.generation_workspace, "generation", "allocated"),
    "eval_kv_cache": (mt.eval_kv_cache, "evaluation", "allocated"),
    "eval_workspace": (mt.eval_workspace, "evaluation", "allocated"),
    "lora_grads": (mt.lora_grads, "training", "allocated"),
    "activations": (mt.activations, "training", "allocated"),
    "prompt_kv": (mt.prompt_kv, "training", "allocated"),
    "logits": (ml.logits, "training", "allocated"),
}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": GIB, "g": GIB, "gi": GIB, "gib": GIB, "gb": 10**9, "m": MIB, "mi": MIB, "mib": MIB, "mb": 10**6,
          "t": 2**40, "tib": 2**40, "tb": 10**12, "b": 1}


@dataclass
class Plan:
    """A predicted peak: the terms (bytes), their sum per phase, and whether it fits the budget."""

    architecture: Architecture
    settings: Settings
    terms: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    total_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    budget_bytes: int | None
    proposal: dict[str, Any] | None = None
    sharing: ms.Sharing | None = None
    sharing_figures: dict[str, int] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)
    """The engine evaluation's batch and memory (evaluation_info); `counted`: its phase is in the peak."""

    @property
    def eval_batch(self) -> int | None:
        """train.eval.batch_size as planned; None when the recipe does not evaluate through the sampling engine."""
        return self.evaluation["batch"] if self.evaluation.get("counted") else None

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `plan --json`."""
        return {"total_bytes": self.total_bytes, "fits": self.fits, "budget_bytes": self.budget_bytes,
                "terms": dict(self.terms), "proposal": self.proposal, "peak_phase": self.peak_phase,
                "phases": dict(self.phases), "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.reserved_bytes, "prompt_sharing": self.sharing_dict(),
                "evaluation": dict(self.evaluation),
                "formulas": {name: _first_line(TERMS[name][0].__doc__) for name in TERMS},
                "settings": dataclasses.asdict(self.settings),
                "architecture": {**dataclasses.asdict(self.architecture),
                                 "total_params": self.architecture.total_params()}}

    def sharing_dict(self) -> dict[str, Any] | None:
        """Which shared-prompt pass applies and why, and the peak with and without it (bytes)."""
        if self.sharing is None:
            return None
        return {"applies": self.sharing.applies, "available": self.sharing.available, "reason": self.sharing.reason,
                **self.sharing_figures}


def _first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc else ""


def parse_size(text: str) -> int:
    """Bytes of a size like 8GiB, 12GB, 24G, 7.5GiB or 512MiB (a bare number is GiB; GB is 10^9)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BadInputError(f"GPU memory {text!r} is not a size", fix="write it like 8GiB, 12GB, 24G or 512MiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise BadInputError(f"GPU memory {text!r} must be positive", fix="e.g. --gpu-memory 8GiB")
    return value


def format_bytes(n: int) -> str:
    """1.23 GiB / 456.7 MiB, for people."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def default_budget(recipe: Recipe) -> int:
    """The recipe's gpu_memory_gb (as GiB), else the visible GPU's total memory."""
    if recipe.gpu_memory_gb:
        return recipe.gpu_memory_gb * GIB
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    raise BadInputError("no GPU memory to plan for: the recipe sets no gpu_memory_gb and no CUDA GPU is visible",
                        fix="pass --gpu-memory, e.g. --gpu-memory 8GiB")


def device_budget(free_bytes: int, total_bytes: int) -> int:
    """Free memory (this process's context spent) + the context the plan counts again, less 5% of the total."""
    return int(free_bytes + mt.CUDA_CONTEXT_BYTES - 0.05 * total_bytes)


def settings_for(recipe: Recipe, gpu_total_bytes: int = 0, gpu_free_bytes: int = 0,
                 sharing: ms.Sharing | None = None) -> Settings:
    """The recipe's memory settings as a one-process CUDA run has them (runtime.planned)."""
    m, t = recipe.model, recipe.train
    at = place(recipe, Launch(), GPU_PLAN)  # a one-process CUDA run
    fp32 = m.dtype == "float32" or t.precision == "fp32"
    sharing = sharing or ms.Sharing(ms.NONE, ms.NONE, "")
    return Settings(
        backend=at.backend, load_in_4bit=m.load_in_4bit, compute_bytes=4 if fp32 else 2, lora_r=recipe.lora.r,
        target_modules=tuple(recipe.lora.target_modules), optim=optimizer_for(t, cuda=True),
        gradient_checkpointing=t.gradient_checkpointing, per_device_batch=t.per_device_train_batch_size,
        generation_batch=t.generation_batch_size(), num_generations=t.num_generations,
        prompt_len=recipe.data.max_prompt_length, completion_len=t.max_completion_length, beta=t.beta,
        fast_inference=at.fast_inference, gpu_memory_utilization=m.gpu_memory_utilization,
        gpu_total_bytes=gpu_total_bytes, gpu_free_bytes=gpu_free_bytes, prompt_sharing=sharing.applies)


def evaluate(arch: Architecture, s: Settings, budget_bytes: int | None = None) -> Plan:
    """Every term, the phase sums and the peak for one architecture and settings."""
    terms = {name: int(func(arch, s)) for name, (func, _, _) in TERMS.items()}
    phases = {phase: sum(v for k, v in terms.items() if TERMS[k][1] == phase)
              for phase in ("static", "generation", "training", "evaluation")}
    peak_phase = "generation" if phases["generation"] > phases["training"] else "training"
    if phases["evaluation"] > phases[peak_phase]:
        peak_phase = "evaluation"
    terms["allocator_slack"] = int(mt.ALLOCATOR_SLACK * phases[peak_phase])
    # paged optimizers allocate CUDA managed memory, which torch's allocator statistics do not show
    paged = s.optim in mt.PAGED_OPTIMIZERS
    allocated = phases[peak_phase] + sum(v for k, v in terms.items() if k in TERMS and TERMS[k][1:] == (
        "static", "allocated") and not (paged and k == "optimizer_state"))
    total = phases["static"] + phases[peak_phase] + terms["allocator_slack"]
    return Plan(arch, s, terms, phases, peak_phase, total, allocated, allocated + terms["allocator_slack"],
                budget_bytes)


def eval_rows(batch: int, samples: int) -> int:
    """Sequences one evaluation call decodes at once: the k samples of batch // k problems, one problem's at least."""
    return max(batch, samples) if batch > 0 else 0


def eval_batch_candidates(upper: int) -> list[int]:
    """`upper`, then the powers of two below it, largest first."""
    return [upper] + [1 << i for i in range(max(upper - 1, 1).bit_length() - 1, -1, -1) if 1 << i < upper]


def evaluation_peak(arch: Architecture, s: Settings, rows: int) -> int:
    """Static terms + the evaluation phase of `rows` sequences + its allocator slack."""
    p = evaluate(arch, dataclasses.replace(s, eval_batch=rows))
    return p.phases["static"] + int((1 + mt.ALLOCATOR_SLACK) * p.phases["evaluation"])


def choose_eval_batch(arch: Architecture, s: Settings, upper: int, samples: int,
                      budget_bytes: int | None) -> int:
    """The largest candidate whose evaluation peak fits the budget (else the step's own peak); the smallest if none."""
    limit = budget_bytes or evaluate(arch, dataclasses.replace(s, eval_batch=0)).total_bytes
    candidates = eval_batch_candidates(upper)
    return next((b for b in candidates if evaluation_peak(arch, s, eval_rows(b, samples)) <= limit), candidates[-1])


def evaluation_info(recipe: Recipe, arch: Architecture, s: Settings, budget_bytes: int | None,
                    fit_eval: bool | None = None) -> dict[str, Any]:
    """The evaluation batch of a CUDA run and its memory: train.eval.batch_size, or (unset, or `fit_eval`) cut to
    the budget by choose_eval_batch, for k `samples` a problem; `counted` when it runs through the engine."""
    e = recipe.train.eval
    upper = e.batch_size or EVAL_BATCH
    planned = e.batch_size is None if fit_eval is None else fit_eval
    samples = max(1, e.stage.samples if e.stage.problems else 1, e.samples if e.every else 1)
    batch = choose_eval_batch(arch, s, upper, samples, budget_bytes) if planned else upper
    rows = eval_rows(batch, samples)
    sized = dataclasses.replace(s, eval_batch=rows)
    # the stage evaluation always samples through the engine, the periodic one unless vLLM generates the rollouts
    # (it samples it then, except with data.calculator)
    counted = bool(e.stage.problems) or bool(e.every and (not s.fast_inference or recipe.data.calculator))
    return {"counted": counted, "batch": batch, "rows": rows, "samples": samples,
            "planned": planned, "upper": upper, "kv_bytes": mt.eval_kv_cache(arch, sized),
            "workspace_bytes": mt.eval_workspace(arch, sized), "peak_bytes": evaluation_peak(arch, s, rows)}


def scoring_settings(compute_bytes: int, prompt_len: int, completion_len: int) -> Settings:
    """A plain transformers model with `compute_bytes` a weight decoding greedily, as a merged export's score runs
    it: no 4-bit base, LoRA, optimizer or GRPO batch beside it."""
    return Settings(backend="hf", load_in_4bit=False, compute_bytes=compute_bytes, lora_r=0, target_modules=(),
                    optim="sgd", gradient_checkpointing=False, per_device_batch=1, generation_batch=0,
                    num_generations=1, prompt_len=prompt_len, completion_len=completion_len, beta=0.0,
                    fast_inference=False, gpu_memory_utilization=0.0, gpu_total_bytes=0)


def scoring_batch(arch: Architecture, compute_bytes: int, prompt_len: int, completion_len: int, upper: int,
                  budget_bytes: int) -> int:
    """Sequences a merged export's score decodes at once: the largest of `upper` (the run's evaluation batch) and the
    powers of two below it whose evaluation peak with the merged weights fits `budget_bytes`; 1 when none does."""
    s = scoring_settings(compute_bytes, prompt_len, completion_len)
    return choose_eval_batch(arch, s, upper, 1, budget_bytes)


def plan(recipe: Recipe, budget_bytes: int | None = None, *, arch: Architecture | None = None,
         allow_hub: bool = True, free_bytes: int | None = None,
         fit_eval: bool | None = None) -> Plan:
    """Predicted peak GPU memory of a recipe; `free_bytes`: the GPU memory free at load (else the budget),
    `fit_eval`: cut the evaluation batch to the budget even when the recipe sets one."""
    arch = arch or load_architecture(recipe.model.name, allow_hub=allow_hub)
    total_gpu = budget_bytes or (recipe.gpu_memory_gb or 0) * GIB
    sharing = ms.sharing_for(arch, place(recipe, Launch(), GPU_PLAN), recipe)
    settings = settings_for(recipe, total_gpu, free_bytes or 0, sharing)
    info = evaluation_info(recipe, arch, settings, budget_bytes, fit_eval)
    if info["counted"]:
        settings = dataclasses.replace(settings, eval_batch=info["rows"])
    result = evaluate(arch, settings, budget_bytes)
    result.sharing = sharing
    result.sharing_figures = sharing_figures(arch, settings, sharing)
    result.evaluation = info
    return result


def sharing_figures(arch: Architecture, s: Settings, sharing: ms.Sharing) -> dict[str, int]:
    """The peak without prompt sharing, with the backend's pass engaged (even where it does not engage), their
    difference."""
    without = evaluate(arch, dataclasses.replace(s, prompt_sharing=ms.NONE)).total_bytes
    engaged = dataclasses.replace(s, prompt_sharing=sharing.available)
    figures = {"peak_without_bytes": without, "peak_with_bytes": evaluate(arch, engaged).total_bytes}
    figures["saving_bytes"] = figures["peak_without_bytes"] - figures["peak_with_bytes"]
    return figures


def format_plan(p: Plan, title: str = "") -> str:
    """The plan as a table for people: terms, phases, total against the budget, and the proposal."""
    s = p.settings
    lines = [f"memory plan{' for ' + title if title else ''}: {p.architecture.source} ({s.backend}, "
             f"{'4-bit' if s.load_in_4bit else f'{8 * s.compute_bytes}-bit'} base, LoRA r={s.lora_r}, "
             f"{p.architecture.total_params() / 1e9:.2f}B params)",
             f"  settings: generation batch {s.generation_batch} x {s.seq_len} tokens (prompt {s.prompt_len} + "
             f"completion {s.completion_len}), micro-batch {s.per_device_batch}, num_generations "
             f"{s.num_generations}, optim {s.optim}, checkpointing {s.gradient_checkpointing}, vLLM {s.fast_inference}",
             f"  {'term':<22}{'phase':<12}{'size':>12}  formula"]
    for name, value in p.terms.items():
        phase = TERMS[name][1] if name in TERMS else p.peak_phase
        doc = _first_line(TERMS[name][0].__doc__) if name in TERMS else "caching-allocator slack on the peak phase"
        lines.append(f"  {name:<22}{phase:<12}{format_bytes(value):>12}  {doc[:70]}")
    lines += _sharing_lines(p) + _evaluation_lines(p)
    verdict = "" if p.fits is None else (" -> fits" if p.fits else " -> does NOT fit")
    budget = f" of {format_bytes(p.budget_bytes)}" if p.budget_bytes else ""
    lines.append(f"  peak ({p.peak_phase} phase): {format_bytes(p.total_bytes)}{budget}{verdict}; torch allocated "
                 f"~{format_bytes(p.allocated_bytes)}, reserved ~{format_bytes(p.reserved_bytes)}")
    if p.proposal:
        lines.append("  largest settings that fit (each with the others as set):")
        for knob, entry in p.proposal.items():
            text = "n/a" if entry is None else f"{entry['value']}  (peak {format_bytes(entry['total_bytes'])})"
            lines.append(f"    {knob:<30}{text}")
    return "\n".join(lines) + "\n"


def _sharing_lines(p: Plan) -> list[str]:
    """Which shared-prompt pass applies, why, and the peak with and without it."""
    if p.sharing is None or not p.sharing_figures:
        return []
    f, sh, s = p.sharing_figures, p.sharing, p.settings
    k = mt.prompts_in_micro_batch(s)
    if sh.available == ms.NONE:
        return [f"  prompt sharing: {sh.reason}"]
    engaged = "" if sh.applies != ms.NONE else " (if it engaged)"
    lines = [f"  prompt sharing: {sh.reason}",
             f"    training forward: {s.per_device_batch} x {s.seq_len} = {mt.forward_tokens(p.architecture, s, False)} "
             f"tokens per micro-batch without it, {k} x {s.prompt_len} + {s.per_device_batch} x {s.completion_len} = "
             f"{mt.forward_tokens(p.architecture, s, True)} with it",
             f"    peak without prompt sharing {format_bytes(f['peak_without_bytes'])}, with our shared-prompt pass{engaged} "
             f"{format_bytes(f['peak_with_bytes'])} (saves {format_bytes(f['saving_bytes'])})"]
    return lines


def _evaluation_lines(p: Plan) -> list[str]:
    """The evaluation batch, where it comes from, and its memory (or what turning it on would take)."""
    e, s = p.evaluation, p.settings
    if not e:
        return []
    upper = e["upper"]
    ladder = (f"power of two up to {upper}" if upper & (upper - 1) == 0
              else f"of {upper} and the powers of two below it")
    source = f"planned: the largest {ladder} that fits" if e["planned"] else "as the recipe sets it"
    size = (f"{e['batch']} sequences at once (train.eval.batch_size, {source})"
            + (f", {e['rows']} with {e['samples']} samples a problem" if e["rows"] != e["batch"] else "")
            + f" x {s.seq_len} tokens: KV cache {format_bytes(e['kv_bytes'])} + workspace "
            f"{format_bytes(e['workspace_bytes'])}, peak {format_bytes(e['peak_bytes'])}")
    if e["counted"]:
        return [f"  evaluation: {size}"]
    return [f"  evaluation: off in this recipe (train.eval.stage.problems=0, and train.eval.every=0 or sampled by "
            f"vLLM); with it on: {size}"]
