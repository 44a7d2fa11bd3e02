"""Which shared-prompt pass a run's training forward gets, and why (docs/memory.md): ours (train/cpu_logprobs.py) on
the hf backend; Unsloth's own prefix grouping is not modelled (the plan counts full rows)."""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_grpo.memory.arch import Architecture
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.runtime import Placement

HF = "shared_prompt"
NONE = "none"


@dataclass(frozen=True)
class Sharing:
    """`applies`: shared_prompt or none; `available`: the backend's pass (what the figure "with prompt sharing"
    models)."""

    applies: str
    available: str
    reason: str


# the devices whose trainer runs our shared-prompt pass (train.trainer.CpuSafeGRPOTrainer)
HF_SHARED_DEVICES = ("cpu",)


def hf_shared_prompt(arch: Architecture, *, shared_prompt: bool, num_generations: int,
                     gradient_checkpointing: bool, device: str = "cuda") -> Sharing:
    """Whether our shared-prompt pass runs the hf backend's loss pass on `device`: every reason it does not."""
    reasons = []
    if not shared_prompt:
        reasons.append("train.cpu.fast=false")
    if num_generations < 2:
        reasons.append("one completion per prompt leaves nothing to share")
    if any(kind != "full_attention" for kind in arch.layer_types):
        reasons.append("the model has sliding-window layers (their caches keep a window)")
    if gradient_checkpointing:
        reasons.append("gradient checkpointing drops the KV cache the completions read, so the loss pass runs full "
                       "rows (train.gradient_checkpointing=false shares it)")
    if device not in HF_SHARED_DEVICES:
        reasons.append(f"on {device} TRL's own log-prob pass runs (ours runs in the CPU trainer)")
    if reasons:
        return Sharing(NONE, HF, "our shared-prompt pass does not run the loss pass: " + "; ".join(reasons))
    return Sharing(HF, HF, "our shared-prompt pass runs (train.cpu.fast=true): each distinct prompt of a "
                           "micro-batch is forwarded once")


def sharing_for(arch: Architecture, runtime: Placement, recipe: Recipe) -> Sharing:
    """The shared-prompt pass a recipe's training forward gets with `runtime`."""
    t = recipe.train
    if runtime.backend == "unsloth":
        return Sharing(NONE, NONE, "Unsloth's own prefix grouping is not modelled: the plan counts full rows (it "
                                   "engages only when a generation round is one group, which no shipped recipe has)")
    return hf_shared_prompt(arch, shared_prompt=t.cpu.fast, num_generations=t.num_generations,
                            gradient_checkpointing=t.gradient_checkpointing, device=runtime.device)
