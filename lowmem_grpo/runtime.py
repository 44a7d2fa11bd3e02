"""The Runtime: what a run of a recipe will be on this machine and launch, with every "auto" made concrete once,
before any model loads: the backend, the device, the dtype and its bf16/fp16 flags, the optimizer, how GRPO
samples and which CPU speed paths run, the trainer class, the batches, Unsloth's vLLM engine and the processes.
`resolve` is the one place where "auto" becomes a value, and this module and backends/ the only places that tell
Unsloth from transformers: everything else reads the Runtime. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from lowmem_grpo.device import CudaFacts, bf16_supported, cpu_auto_dtype, cuda_available, is_installed
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe import Recipe, TrainConfig

PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
"""The sampling settings lowmem_grpo's engine implements (TRL's defaults): plain sampling at the temperature."""
EVAL_BATCH = 128
"""Sequences an evaluation decodes at once where nothing planned train.eval.batch_size (on CPU: a decode step's
matmuls over 128 rows of a small model cost little more than over 32; 100 problems greedy + 100 x 4 samples, 64
tokens each: 77 s at 32, 49 s at 128, native bf16; the KV cache of 128 rows of SmolLM2-135M is ~0.4 GiB at 150
tokens), and the most the plan gives on a GPU."""


@dataclass(frozen=True)
class RolloutPlan:
    """Whether GRPO samples through the engine (`engine`), with the calculator (`calculator`), on vLLM through
    the calculator's rounds (`vllm`: lowmem_grpo.sampling.rollout.VllmRollout), and why."""

    engine: bool
    calculator: bool
    reason: str
    vllm: bool = False
    own_vllm: bool = False
    """train.vllm_sampling: on a vLLM engine lowmem_grpo starts itself (lowmem_grpo.sampling.rollout.OwnVllmRollout)."""

    def describe(self) -> str:
        """What samples GRPO's rollouts, for the log."""
        if self.own_vllm:
            return "lowmem_grpo's vLLM engine, the live adapter as a LoRA request" + (
                " with the calculator" if self.calculator else "")
        if self.vllm:
            return "vLLM with the calculator"
        if self.engine:
            return "lowmem_grpo's engine" + (" with the calculator" if self.calculator else "")
        return "TRL's generation"


@dataclass(frozen=True)
class CpuPaths:
    """lowmem_grpo's CPU speed paths, each computing what the plain path does to float rounding: all on where
    train.cpu.fast is true and the run is on a CPU (`cpu_paths`). Each is also an argument of the code it speeds
    (a trainer attribute, a sampling argument), so its own exactness test switches it alone. The fourth, sampling
    GRPO's completions through lowmem_grpo's engine, is the RolloutPlan's."""

    shared_prompt: bool = True
    """The log-prob passes forward each GRPO group's prompt once (lowmem_grpo.train.cpu_logprobs)."""
    merged: bool = True
    """Sampling from the LoRA adapter merged into the weights (lowmem_grpo.sampling.generate.merged_adapter)."""
    attention: bool = True
    """Sampling and log-prob passes through lowmem_grpo's attention (lowmem_grpo.sampling.attention)."""


def cpu_paths(train: TrainConfig, device: str) -> CpuPaths:
    """The CPU speed paths of a run on `device` (cpu or cuda): all on with train.cpu.fast on a CPU, else none."""
    on = train.cpu.fast and device == "cpu"
    return CpuPaths(shared_prompt=on, merged=on, attention=on)


@dataclass(frozen=True)
class Runtime:
    """A run of a recipe as it will be: `resolve` builds it once from the recipe, the launch and the machine."""

    backend: str
    """unsloth or hf (model.backend=auto: unsloth with CUDA, Unsloth installed and one process, else hf)."""
    device: str
    """cuda or cpu: cuda for a GPU recipe (gpu_memory_gb set) or where torch sees a GPU."""
    dtype: str
    """The model's dtype: the one asked for until the model loads, then the one it was really loaded in (`loaded`)."""
    bf16: bool
    """GRPOConfig/SFTConfig bf16 (train.precision with the dtype; both flags are always set, TRL resolves None)."""
    fp16: bool
    """GRPOConfig/SFTConfig fp16."""
    precision: str
    """train.precision as the recipe gives it (auto, bf16, fp16, fp32): `loaded` re-derives the flags from it."""
    optimizer: str
    """TrainingArguments.optim: train.optim, auto -> paged_adamw_8bit on CUDA, adamw_torch on CPU."""
    sampler: RolloutPlan
    """How GRPO samples its completions: lowmem_grpo's engine (with the calculator), vLLM, or TRL's generation."""
    trainer: str
    """cpu (lowmem_grpo's CPU-safe trainers, for hf on CPU) or trl (TRL's, Unsloth's patched ones under Unsloth)."""
    generation_batch: int
    """Completions generated per generation round on each process (train.generation_batch_size)."""
    eval_batch: int
    """Sequences each stage and periodic evaluation decodes at once."""
    fast_inference: bool
    """Unsloth's vLLM generation: model.fast_inference, opt-in (only an explicit true), on the unsloth backend on
    CUDA. vLLM needs its own resolved set (`pip install -c constraints-vllm.txt -e '.[vllm]'`), so being importable
    says nothing about whether it matches this torch."""
    launch: Launch
    """The processes and DeepSpeed ZeRO stage the launcher set up (lowmem_grpo.distributed.launch)."""
    cpu: CpuPaths
    """The CPU speed paths that run (`cpu_paths`)."""
    dtype_reason: str = ""
    """Why model.dtype=auto became `dtype` on a CPU (its native bf16 or LOWMEM_GRPO_CPU_DTYPE); empty otherwise."""

    @property
    def cuda(self) -> bool:
        """Whether the run is on a CUDA GPU."""
        return self.device == "cuda"

    @property
    def processes(self) -> int:
        """The launcher's processes (1 without a launcher)."""
        return self.launch.num_processes

    def describe(self) -> str:
        """One line, e.g. "backend hf on cuda, 2 processes, DeepSpeed ZeRO-3"."""
        return f"backend {self.backend} on {self.device}, {self.launch.describe()}"

    def block(self) -> str:
        """The Runtime as `validate`, `plan` and `train` print it: one setting a line."""
        flags = "bf16" if self.bf16 else "fp16" if self.fp16 else "none (fp32 or the 16-bit weights as loaded)"
        rows = [("backend", self.backend), ("device", self.device),
                ("dtype", self.dtype + (f" ({self.dtype_reason})" if self.dtype_reason else "")),
                ("precision", f"{self.precision} -> {flags}"), ("optimizer", self.optimizer),
                ("sampler", f"{self.sampler.describe()} ({self.sampler.reason})"),
                ("trainer", "lowmem_grpo's CPU trainer" if self.trainer == "cpu" else "TRL's trainer"),
                ("generation batch", str(self.generation_batch)), ("eval batch", str(self.eval_batch)),
                ("fast inference", "on (Unsloth's vLLM)" if self.fast_inference else "off"),
                ("processes", self.launch.describe())]
        return "runtime:\n" + "".join(f"  {k:<18}{v}\n" for k, v in rows)

    def loaded(self, dtype: str) -> Runtime:
        """This Runtime with the dtype the model was really loaded in (lowmem_grpo.device.model_dtype), and the
        flags that follow it."""
        return dataclasses.replace(self, dtype=dtype, **_precision_flags(self.precision, dtype, cuda=self.cuda))

    def check_precision(self) -> None:
        """BadInputError (exit 2) for a train.precision the Unsloth CUDA path would refuse on this dtype (the one
        the model was loaded in, for training: before anything is written)."""
        check_precision(self.precision, cuda=self.cuda, backend=self.backend, dtype=self.dtype)

    def with_batches(self, recipe: Recipe) -> Runtime:
        """This Runtime with the generation and evaluation batches of `recipe` (as auto-fit fitted them)."""
        return dataclasses.replace(self, generation_batch=recipe.train.generation_batch_size(self.processes),
                                   eval_batch=eval_batch_size(recipe.train))


def resolve(recipe: Recipe, launch: Launch, facts: CudaFacts, environ: Mapping[str, str] | None = None, *,
            training: bool = True) -> Runtime:
    """The Runtime of `recipe` under `launch` on the machine `facts` describe (lowmem_grpo.device.cuda_facts; a
    test builds its own). For `training`, a GPU recipe (gpu_memory_gb set) is resolved for CUDA wherever it is
    checked (without a usable GPU `train` refuses it); otherwise (an evaluation, the preflight) and for a CPU
    recipe, for CUDA where the machine has it. `environ` (default os.environ) holds LOWMEM_GRPO_CPU_DTYPE.
    BadInputError (exit 2) for model.backend=unsloth under DeepSpeed ZeRO-3 and for an unknown
    LOWMEM_GRPO_CPU_DTYPE; lowmem_grpo.combinations.check refuses the rest."""
    cuda = facts.available or (training and bool(recipe.gpu_memory_gb))
    m, t = recipe.model, recipe.train
    backend = backend_for(m.backend, cuda=cuda, launch=launch)
    auto, reason = auto_dtype(facts, environ, cuda=cuda)  # an unknown LOWMEM_GRPO_CPU_DTYPE stops a CPU run
    dtype, reason = (auto, reason) if m.dtype == "auto" else (m.dtype, "")
    device = "cuda" if cuda else "cpu"
    return Runtime(backend=backend, device=device, dtype=dtype, precision=t.precision,
                   **_precision_flags(t.precision, dtype, cuda=cuda),
                   optimizer=t.optim if t.optim != "auto" else ("paged_adamw_8bit" if cuda else "adamw_torch"),
                   sampler=rollout_plan(recipe, backend, device), trainer=trainer_kind(backend, device),
                   generation_batch=t.generation_batch_size(launch.num_processes), eval_batch=eval_batch_size(t),
                   fast_inference=m.fast_inference is True and (backend, device) == ("unsloth", "cuda"),
                   launch=launch, cpu=cpu_paths(t, device), dtype_reason=reason)


def auto_dtype(facts: CudaFacts, environ: Mapping[str, str] | None = None, *, cuda: bool | None = None
               ) -> tuple[str, str]:
    """What model.dtype=auto is on the machine `facts` describe (on CUDA when `cuda`; None: where it has a GPU),
    and why, when there is more to say: bfloat16 on compute capability >= 8, float16 on older GPUs (off the GPU,
    where its capability is unknown, bfloat16: every GPU since Ampere); on CPU lowmem_grpo.device.cpu_auto_dtype (LOWMEM_GRPO_CPU_DTYPE in
    `environ`, else native bf16 or float32; BadInputError for an unknown value). What the model is then really
    loaded in is Runtime.loaded's (Unsloth may change it)."""
    if not (facts.available if cuda is None else cuda):
        cpu = cpu_auto_dtype(environ)
        return cpu.dtype, cpu.reason
    if facts.capability is None:  # validate/plan off the GPU: the GPU decides when the model loads
        return "bfloat16", "the GPU is not known here: float16 below compute capability 8"
    return ("bfloat16" if bf16_supported(facts.capability) else "float16"), ""


GPU_PLAN = CudaFacts(torch_cuda="planned", available=True)
"""The machine the memory planner plans for: one CUDA GPU (its capability unknown)."""


def before_cuda(recipe: Recipe, training: bool = True) -> CudaFacts:
    """What `resolve` needs of this machine before CUDA starts: whether torch sees a GPU (asked only for a recipe
    that is not resolved for CUDA anyway: a GPU recipe's training run, the case `validate` judges without torch)."""
    if training and recipe.gpu_memory_gb:
        return GPU_PLAN
    return CudaFacts(torch_cuda=None, available=cuda_available())


def planned(recipe: Recipe) -> Runtime:
    """The Runtime of a one-process CUDA run of `recipe`: what lowmem_grpo.memory plans the peak memory of."""
    return resolve(recipe, Launch(), GPU_PLAN)


def backend_for(requested: str, *, cuda: bool, launch: Launch) -> str:
    """model.backend: auto -> unsloth when CUDA and unsloth are both present and one process runs (not under
    ZeRO-3), else hf.

    An explicit unsloth runs under DDP and DeepSpeed ZeRO-1/2, where every rank holds the whole model: Unsloth
    2026.10.9 loads each rank on its own GPU (unsloth/models/loader_utils.py prepare_device_map, cuda:LOCAL_RANK),
    decides DDP's unused-parameter search (unsloth/models/_ddp_defaults.py) and averages the LoRA gradients
    across ranks itself (unsloth/models/rl.py _unsloth_average_gradients). ZeRO-3 is refused: Unsloth's fused
    LoRA kernels read each projection's base weight directly inside the MLP/attention forward
    (unsloth/kernels/utils.py get_lora_parameters, kernels/fast_lora.py apply_lora_mlp_swiglu), where ZeRO-3
    has gathered nothing (it gathers a module's parameters only around that module's own forward)."""
    if requested == "unsloth" and launch.zero_stage == 3:
        raise BadInputError(f"model.backend=unsloth under DeepSpeed ZeRO-3 ({launch.describe()}): Unsloth's fused "
                            "LoRA kernels read each layer's base weight directly, outside the module forward where "
                            "ZeRO-3 gathers its partitioned parameters",
                            fix="set model.backend=hf for ZeRO-3, or launch unsloth with DDP or ZeRO-2 "
                                "(recipes/accelerate/ddp.yaml, zero2.yaml)")
    if requested != "auto":
        return requested
    alone = launch.num_processes == 1 and launch.zero_stage != 3
    return "unsloth" if cuda and alone and is_installed("unsloth") else "hf"


def trainer_kind(backend: str, device: str) -> str:
    """cpu for the hf backend on CPU (lowmem_grpo's CPU-safe trainers), trl everywhere else."""
    return "cpu" if (backend, device) == ("hf", "cpu") else "trl"


def eval_batch_size(train: TrainConfig) -> int:
    """Sequences each stage and periodic evaluation call decodes at once: train.eval.batch_size (on a GPU auto-fit
    sets it from the memory plan: lowmem_grpo.memory.fit.with_planned_eval_batch), else EVAL_BATCH (at least the
    micro-batch)."""
    return train.eval.batch_size or max(EVAL_BATCH, train.per_device_train_batch_size)


def custom_sampling(recipe: Recipe) -> list[str]:
    """The sampling settings under train (TRL's GRPOConfig fields) that ask for more than plain sampling at the
    temperature, sorted."""
    extra = recipe.train.extra
    custom = sorted(k for k, v in PLAIN_SAMPLING.items() if k in extra and extra[k] != v)
    return custom + (["generation_kwargs"] if extra.get("generation_kwargs") else [])


def on_vllm(recipe: Recipe, backend: str) -> bool:
    """Whether GRPO's generation runs on vLLM: TRL's train.use_vllm, or Unsloth's fast_inference engine."""
    return bool(recipe.train.extra.get("use_vllm")) or (backend == "unsloth" and recipe.model.fast_inference is True)


def rollout_plan(recipe: Recipe, backend: str, device: str) -> RolloutPlan:
    """How GRPO samples its completions. With data.calculator: on vLLM (`on_vllm`) through the calculator's rounds
    (rows stop after each token ending in "=", TRL's own sampling settings), else through lowmem_grpo's sampling
    engine, on either backend. Without it: the engine for the hf backend on CPU (faster there than transformers'
    generate; train.cpu.fast=false, or a sampling setting the engine lacks, leaves it to TRL), TRL's
    generation otherwise. It only decides: lowmem_grpo.combinations.check refuses what a run could not honour."""
    custom = custom_sampling(recipe)
    if recipe.train.vllm_sampling:
        return RolloutPlan(False, recipe.data.calculator, "train.vllm_sampling", vllm=True, own_vllm=True)
    if recipe.data.calculator:
        if on_vllm(recipe, backend):
            return RolloutPlan(False, True, "data.calculator on vLLM: rows stop at each token ending in '=', the "
                               "calculator's results are forced in (masked out) and the rows resubmitted", vllm=True)
        return RolloutPlan(True, True, "data.calculator: the engine forces the calculator's results (masked out)")
    if not recipe.train.cpu.fast:
        return RolloutPlan(False, False, "train.cpu.fast is false")
    if trainer_kind(backend, device) == "cpu" and not custom:
        return RolloutPlan(True, False, "the hf backend on CPU samples through lowmem_grpo's engine")
    why = f"train.{custom[0]} is set" if custom else "TRL's generation on this backend/device"
    return RolloutPlan(False, False, why)


def _precision_flags(precision: str, dtype: str, *, cuda: bool) -> dict[str, bool]:
    """GRPOConfig/SFTConfig bf16 and fp16 flags from train.precision and the model's dtype. auto: CPU -> none (fp32,
    or the 16-bit weights as loaded); CUDA -> the dtype's own flag (a float32 model trains in float32). Explicit
    values are honoured (check_precision refuses those the Unsloth CUDA path would refuse or override)."""
    if precision == "auto":
        if not cuda:
            return {"bf16": False, "fp16": False}
        return {"bf16": dtype == "bfloat16", "fp16": dtype == "float16"}
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def check_precision(precision: str, *, cuda: bool, backend: str, dtype: str | None = None) -> None:
    """BadInputError (exit 2) for a train.precision the Unsloth CUDA path would refuse or override: fp32 always
    (known before the model loads: `dtype` None), bf16/fp16 against the dtype the model was loaded in. Its
    trainer raises on a flag that disagrees with a 16-bit model and turns fp32 into bf16/fp16 autocast: stopping
    here beats failing at trainer construction or training in a precision nobody chose."""
    if not cuda or backend != "unsloth" or precision == "auto":
        return
    if precision == "fp32":
        raise BadInputError(
            f"train.precision=fp32 with model.backend=unsloth on CUDA: Unsloth's trainer turns fp32 into bf16/fp16 "
            f"autocast on any GPU that reports bfloat16, emulated included (unsloth/models/rl.py, mixed-precision "
            f"check{f'; this model is {dtype}' if dtype else ''}); only the models it forces to float32 (Gemma 3) "
            f"stay in float32, and train.precision=auto already gives them that",
            fix="use model.backend=hf for float32 training, or train.precision=auto")
    if dtype is None:
        return
    wanted = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    if dtype in ("bfloat16", "float16") and dtype != wanted:
        why = (" (this GPU has no native bfloat16: compute capability below 8, so Unsloth loaded float16)"
               if dtype == "float16" else "")
        raise BadInputError(
            f"train.precision={precision} but the model was loaded in {dtype}{why}; Unsloth's trainer refuses "
            f"{precision} on a {dtype} model",
            fix=f"use train.precision=auto (here {dtype}), or model.dtype={wanted} on a GPU that computes it")
