"""The Runtime: a run of a recipe on this machine and launch with every "auto" made concrete once, before any model
loads. `resolve` is the one place where "auto" becomes a value; this module and backends/ are the only places that
tell Unsloth from transformers."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

from lowmem_grpo.device import (CudaFacts, bf16_supported, cpu_auto_dtype, cuda_available, installed_vllm_problem,
                                is_installed)
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe import AUTO, Recipe, TrainConfig, goal_reward, resolved_rewards

# the sampling settings lowmem_grpo's engine implements (TRL's defaults): plain sampling at the temperature
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
# sequences an evaluation decodes at once unless planned (on CPU 128 rows cost little more than 32: 49 s against
# 77 s for a 100-problem evaluation), and the most the plan gives on a GPU
EVAL_BATCH = 128


@dataclass(frozen=True)
class RolloutPlan:
    """Whether GRPO samples through the engine, with the calculator, on vLLM through the calculator's rounds
    (sampling.rollout.VllmRollout), and why."""

    engine: bool
    calculator: bool
    reason: str
    vllm: bool = False
    own_vllm: bool = False
    """train.vllm_sampling: on a vLLM engine lowmem_grpo starts itself (sampling.rollout.OwnVllmRollout)."""

    def describe(self) -> str:
        """What samples GRPO's rollouts, for the log."""
        calculator = " with the calculator" if self.calculator else ""
        if self.own_vllm:
            return "lowmem_grpo's vLLM engine, the live adapter as a LoRA request" + calculator
        if self.vllm:
            return "vLLM with the calculator"
        return "lowmem_grpo's engine" + calculator if self.engine else "TRL's generation"


@dataclass(frozen=True)
class FastInference:
    """Whether Unsloth's vLLM engine generates GRPO's rollouts (model.fast_inference resolved), and why."""

    on: bool
    reason: str


def choose_fast_inference(recipe: Recipe, backend: str, device: str, processes: int, *, vllm_problem: str | None,
                          room: bool | None) -> FastInference:
    """model.fast_inference: true on the unsloth backend on CUDA, false and null off; auto on when the run is one
    unsloth process on CUDA whose recipe samples on no other vLLM, `vllm_problem` is None (a CUDA vLLM that Unsloth
    runs is installed: device.vllm_problem) and `room` is not False (the memory plan fits vLLM's pool beside training
    on this GPU: memory.fit.vllm_room; None: not known yet, decided when training starts)."""
    requested = recipe.model.fast_inference
    engine = (backend, device) == ("unsloth", "cuda")
    if requested != AUTO:
        on = requested is True and engine
        return FastInference(on, f"model.fast_inference={ {True: 'true', False: 'false', None: 'null'}.get(requested)}")
    why_not = (f"Unsloth's vLLM runs on the unsloth backend on CUDA, this run is {backend} on {device}" if not engine
               else f"{processes} processes: auto turns it on for one" if processes > 1
               else "train.vllm_sampling samples on lowmem_grpo's own vLLM engine" if recipe.train.vllm_sampling
               else "train.use_vllm samples on TRL's vLLM" if recipe.train.extra.get("use_vllm")
               else vllm_problem
               or ("the memory plan has no room for vLLM's pool beside training on this GPU" if room is False else None))
    if why_not:
        return FastInference(False, f"auto: {why_not}")
    return FastInference(True, "auto: vLLM is installed and " + (
        "the memory plan fits its pool beside training" if room else "the GPU's room is checked when training starts"))


def fast_inference_for(recipe: Recipe, backend: str, device: str, processes: int, *,
                       room: bool | None = None) -> FastInference:
    """choose_fast_inference asking this environment whether a vLLM that Unsloth runs is installed (only for
    model.fast_inference=auto)."""
    problem = installed_vllm_problem(recipe.model.load_in_4bit) if recipe.model.fast_inference == AUTO else None
    return choose_fast_inference(recipe, backend, device, processes, vllm_problem=problem, room=room)


def settle_fast_inference(recipe: Recipe, runtime: Runtime) -> Recipe:
    """A recipe with model.fast_inference=auto with the Runtime's choice in it: it holds true or false from here on
    (its recipe.yaml, a resume and the memory plan read that). Any other recipe comes back as it is."""
    if recipe.model.fast_inference != AUTO:
        return recipe
    settled = copy.deepcopy(recipe)
    settled.model.fast_inference = runtime.fast_inference
    return settled


@dataclass(frozen=True)
class CpuPaths:
    """lowmem_grpo's CPU speed paths, each exact to float rounding, each an argument of the code it speeds (so its
    own test switches it alone); sampling through the engine is the RolloutPlan's."""

    shared_prompt: bool = True
    """The log-prob passes forward each GRPO group's prompt once (train.cpu_logprobs)."""
    merged: bool = True
    """Sampling from the LoRA adapter merged into the weights (sampling.generate.merged_adapter)."""
    attention: bool = True
    """Sampling and log-prob passes through lowmem_grpo's attention (sampling.attention)."""


def cpu_paths(train: TrainConfig, device: str) -> CpuPaths:
    """All on with train.cpu.fast on a CPU, else none."""
    on = train.cpu.fast and device == "cpu"
    return CpuPaths(shared_prompt=on, merged=on, attention=on)


class _Where:
    """What the Runtime and the Placement say alike of where a run goes (both carry backend, device and launch)."""

    backend: str
    device: str
    launch: Launch

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def processes(self) -> int:
        return self.launch.num_processes

    def describe(self) -> str:
        """One line, e.g. "backend hf on cuda, 2 processes, DeepSpeed ZeRO-2"."""
        return f"backend {self.backend} on {self.device}, {self.launch.describe()}"


@dataclass(frozen=True)
class Runtime(_Where):
    """A run of a recipe as it will be: `resolve` builds it once from the recipe, the launch and the machine."""

    backend: str
    """unsloth or hf (model.backend=auto: unsloth with CUDA, Unsloth installed and one process, else hf)."""
    device: str
    """cuda or cpu: cuda for a GPU recipe (gpu_memory_gb set) or where torch sees a GPU."""
    dtype: str
    """The dtype the model is asked for (Unsloth on CUDA with model.dtype=auto picks its own: `flags`)."""
    bf16: bool
    """bf16 for `dtype` (train.precision with the dtype; always set, TRL resolves None)."""
    fp16: bool
    """fp16 for `dtype`."""
    precision: str
    """train.precision as the recipe gives it: `flags` derives the flags of a loaded dtype from it."""
    optimizer: str
    """TrainingArguments.optim: train.optim, auto -> paged_adamw_8bit on CUDA, adamw_torch on CPU."""
    sampler: RolloutPlan
    """How GRPO samples its completions."""
    trainer: str
    """cpu (lowmem_grpo's CPU-safe trainers, for hf on CPU) or trl."""
    fast_inference: bool
    """Unsloth's vLLM generation (choose_fast_inference): true on the unsloth backend on CUDA, or auto there with a
    usable vLLM installed and room for it."""
    launch: Launch
    """The processes and DeepSpeed ZeRO stage the launcher set up."""
    cpu: CpuPaths
    """The CPU speed paths that run."""
    rewards: dict[str, float]
    """Reward name -> weight: the recipe's rewards, else the task's default set (recipe.resolved_rewards)."""
    goal_reward: str | None
    """The key of `rewards` that defines success (recipe.goal_reward); None: only the total."""
    dtype_reason: str = ""
    """Why model.dtype=auto became `dtype`; empty otherwise."""
    fast_inference_reason: str = ""
    """Why fast_inference is on or off (choose_fast_inference)."""

    def block(self, recipe: Recipe) -> str:
        """The Runtime (with `recipe`'s batches) as `validate`, `plan` and `train` print it: one setting a line."""
        flags = "bf16" if self.bf16 else "fp16" if self.fp16 else "none (fp32 or the 16-bit weights as loaded)"
        rows = [("backend", self.backend), ("device", self.device),
                ("dtype", self.dtype + (f" ({self.dtype_reason})" if self.dtype_reason else "")),
                ("precision", f"{self.precision} -> {flags}"), ("optimizer", self.optimizer),
                ("sampler", f"{self.sampler.describe()} ({self.sampler.reason})"),
                ("trainer", "lowmem_grpo's CPU trainer" if self.trainer == "cpu" else "TRL's trainer"),
                ("generation batch", str(recipe.train.generation_batch_size(self.processes))),
                ("eval batch", str(eval_batch_size(recipe.train))),
                ("fast inference", ("on (Unsloth's vLLM)" if self.fast_inference else "off")
                 + (f" ({self.fast_inference_reason})" if self.fast_inference_reason else "")),
                ("rewards", ", ".join(f"{k} x{w:g}" for k, w in self.rewards.items())
                 + (f" (goal: {self.goal_reward})" if self.goal_reward else " (no goal reward: the total only)")),
                ("processes", self.launch.describe())]
        return "runtime:\n" + "".join(f"  {k:<18}{v}\n" for k, v in rows)

    def flags(self, dtype: str) -> tuple[bool, bool]:
        """(bf16, fp16) for the dtype the model was loaded in (device.model_dtype)."""
        flags = _precision_flags(self.precision, dtype, cuda=self.cuda)
        return flags["bf16"], flags["fp16"]

    def trainer_args(self, dtype: str | None = None) -> dict[str, object]:
        """The TrainingArguments every trainer of the run shares: the optimizer, the device, no progress bar (the
        telemetry line per step carries progress and ETA) and the bf16/fp16 flags of `dtype`, the dtype the model
        was loaded in (default the Runtime's)."""
        bf16, fp16 = self.flags(dtype or self.dtype)
        return {"optim": self.optimizer, "use_cpu": not self.cuda, "disable_tqdm": True, "bf16": bf16, "fp16": fp16}


@dataclass(frozen=True)
class Placement(_Where):
    """Where a recipe runs under a launch, known before CUDA starts: what `combinations.check` judges and the
    Runtime is resolved from."""

    backend: str
    device: str
    fast_inference: bool
    sampler: RolloutPlan
    launch: Launch

    # cuda, processes and describe() come from _Where, as the Runtime's


def place(recipe: Recipe, launch: Launch, facts: CudaFacts, *, training: bool = True) -> Placement:
    """For `training`, a GPU recipe is placed on CUDA wherever it is checked (`train` refuses it without a GPU);
    otherwise on CUDA where the machine has it."""
    cuda = facts.available or (training and bool(recipe.gpu_memory_gb))
    backend, device = backend_for(recipe.model.backend, cuda=cuda, launch=launch), "cuda" if cuda else "cpu"
    fast = fast_inference_for(recipe, backend, device, launch.num_processes).on  # auto: the GPU's room unknown yet
    return Placement(backend=backend, device=device, launch=launch, fast_inference=fast,
                     sampler=rollout_plan(recipe, backend, device, fast))


def resolve(recipe: Recipe, launch: Launch, facts: CudaFacts, environ: Mapping[str, str] | None = None, *,
            training: bool = True, cpu: CpuPaths | None = None, vllm_room: bool | None = None) -> Runtime:
    """The Runtime of `recipe` under `launch` on the machine `facts` describe, where `place` puts it. `environ`
    (default os.environ) holds LOWMEM_GRPO_CPU_DTYPE; `cpu` replaces the CPU speed paths train.cpu.fast gives;
    `vllm_room`: whether the memory plan fits vLLM's pool on this GPU (memory.fit.vllm_room; None: not known), for
    model.fast_inference=auto."""
    at = place(recipe, launch, facts, training=training)
    m, t = recipe.model, recipe.train
    auto, reason = auto_dtype(facts, environ, cuda=at.cuda)  # an unknown LOWMEM_GRPO_CPU_DTYPE stops a CPU run
    dtype, reason = (auto, reason) if m.dtype == "auto" else (m.dtype, "")
    fast = fast_inference_for(recipe, at.backend, at.device, launch.num_processes, room=vllm_room)
    return Runtime(backend=at.backend, device=at.device, dtype=dtype, precision=t.precision,
                   **_precision_flags(t.precision, dtype, cuda=at.cuda),
                   optimizer=optimizer_for(t, cuda=at.cuda),
                   sampler=rollout_plan(recipe, at.backend, at.device, fast.on),
                   trainer="cpu" if (at.backend, at.device) == ("hf", "cpu") else "trl",
                   rewards=resolved_rewards(recipe), goal_reward=goal_reward(recipe), fast_inference=fast.on,
                   fast_inference_reason=fast.reason, launch=launch, cpu=cpu or cpu_paths(t, at.device),
                   dtype_reason=reason)


def auto_dtype(facts: CudaFacts, environ: Mapping[str, str] | None = None, *, cuda: bool | None = None
               ) -> tuple[str, str]:
    """model.dtype=auto on CUDA (bfloat16 from capability 8 or unknown, else float16) or CPU, and why."""
    if not (facts.available if cuda is None else cuda):
        cpu = cpu_auto_dtype(environ)
        return cpu.dtype, cpu.reason
    if facts.capability is None:  # validate/plan off the GPU: the GPU decides when the model loads
        return "bfloat16", "the GPU is not known here: float16 below compute capability 8"
    return ("bfloat16" if bf16_supported(facts.capability) else "float16"), ""


GPU_PLAN = CudaFacts(torch_cuda="planned", available=True)  # what the planner plans for: a GPU of unknown capability


def before_cuda(recipe: Recipe, training: bool = True) -> CudaFacts:
    """What `resolve` needs of this machine before CUDA starts (a GPU recipe's training run asks nothing)."""
    if training and recipe.gpu_memory_gb:
        return GPU_PLAN
    return CudaFacts(torch_cuda=None, available=cuda_available())


def optimizer_for(train: TrainConfig, *, cuda: bool) -> str:
    """train.optim: auto -> paged_adamw_8bit on CUDA, adamw_torch on CPU."""
    return train.optim if train.optim != "auto" else ("paged_adamw_8bit" if cuda else "adamw_torch")


def planned(recipe: Recipe) -> Runtime:
    """The Runtime of a one-process CUDA run of `recipe`: what `plan` prints (memory/ plans from `place`)."""
    return resolve(recipe, Launch(), GPU_PLAN)


def backend_for(requested: str, *, cuda: bool, launch: Launch) -> str:
    """model.backend: auto -> unsloth with CUDA, Unsloth installed and one process, else hf. An explicit unsloth
    runs under DDP and ZeRO-1/2 (each rank holds the whole model)."""
    if requested != "auto":
        return requested
    return "unsloth" if cuda and launch.num_processes == 1 and is_installed("unsloth") else "hf"


def eval_batch_size(train: TrainConfig) -> int:
    """Sequences each evaluation call decodes at once: train.eval.batch_size, else EVAL_BATCH (or the micro-batch)."""
    return train.eval.batch_size or max(EVAL_BATCH, train.per_device_train_batch_size)


def custom_sampling(recipe: Recipe) -> list[str]:
    """The train sampling settings that ask for more than plain sampling at the temperature, sorted."""
    extra = recipe.train.extra
    custom = sorted(k for k, v in PLAIN_SAMPLING.items() if k in extra and extra[k] != v)
    return custom + (["generation_kwargs"] if extra.get("generation_kwargs") else [])


def on_vllm(recipe: Recipe, fast_inference: bool) -> bool:
    """Whether GRPO's generation runs on vLLM: TRL's train.use_vllm, or Unsloth's engine (`fast_inference`, the
    Runtime's)."""
    return bool(recipe.train.extra.get("use_vllm")) or fast_inference


def rollout_plan(recipe: Recipe, backend: str, device: str, fast_inference: bool | None = None) -> RolloutPlan:
    """How GRPO samples: the calculator on vLLM or the engine; else the engine for hf on CPU, or TRL's.
    `fast_inference`: the Runtime's (default: an explicit model.fast_inference=true on the unsloth backend)."""
    if fast_inference is None:
        fast_inference = backend == "unsloth" and recipe.model.fast_inference is True
    custom = custom_sampling(recipe)
    if recipe.train.vllm_sampling:
        return RolloutPlan(False, recipe.data.calculator, "train.vllm_sampling", vllm=True, own_vllm=True)
    if recipe.data.calculator:
        if on_vllm(recipe, fast_inference):
            return RolloutPlan(False, True, "data.calculator on vLLM: rows stop at each token ending in '=', the "
                               "calculator's results are forced in (masked out) and the rows resubmitted", vllm=True)
        return RolloutPlan(True, True, "data.calculator: the engine forces the calculator's results (masked out)")
    if not recipe.train.cpu.fast:
        return RolloutPlan(False, False, "train.cpu.fast is false")
    if (backend, device) == ("hf", "cpu") and not custom:
        return RolloutPlan(True, False, "the hf backend on CPU samples through lowmem_grpo's engine")
    why = f"train.{custom[0]} is set" if custom else "TRL's generation on this backend/device"
    return RolloutPlan(False, False, why)


def _precision_flags(precision: str, dtype: str, *, cuda: bool) -> dict[str, bool]:
    """bf16/fp16 flags: auto is none on CPU and the dtype's own on CUDA; explicit values are honoured."""
    if precision == "auto":
        return {"bf16": cuda and dtype == "bfloat16", "fp16": cuda and dtype == "float16"}
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def check_precision(precision: str, *, cuda: bool, backend: str) -> None:
    """BadInputError for train.precision=fp32 on the Unsloth CUDA path, which overrides it (before the model loads;
    check_loaded_dtype judges bf16/fp16 against the dtype it loads in)."""
    if cuda and backend == "unsloth" and precision == "fp32":
        raise BadInputError(
            "train.precision=fp32 with model.backend=unsloth on CUDA: Unsloth's trainer turns fp32 into bf16/fp16 "
            "autocast on any GPU that reports bfloat16, emulated included (unsloth/models/rl.py, mixed-precision "
            "check); only the models it forces to float32 (Gemma 3) stay in float32, and train.precision=auto "
            "already gives them that", fix="use model.backend=hf for float32 training, or train.precision=auto")


def check_loaded_dtype(runtime: Runtime, dtype: str) -> None:
    """BadInputError for a train.precision of bf16/fp16 that Unsloth's trainer refuses on the dtype the model was
    loaded in."""
    precision = runtime.precision
    if not runtime.cuda or runtime.backend != "unsloth" or precision not in ("bf16", "fp16"):
        return
    wanted = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    if dtype in ("bfloat16", "float16") and dtype != wanted:
        why = (" (this GPU has no native bfloat16: compute capability below 8, so Unsloth loaded float16)"
               if dtype == "float16" else "")
        raise BadInputError(
            f"train.precision={precision} but the model was loaded in {dtype}{why}; Unsloth's trainer refuses "
            f"{precision} on a {dtype} model",
            fix=f"use train.precision=auto (here {dtype}), or model.dtype={wanted} on a GPU that computes it")
