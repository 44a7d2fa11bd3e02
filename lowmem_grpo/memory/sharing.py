"""Which shared-prompt pass a run's training forward gets, and why (docs/memory.md): Unsloth's PrefixGrouper
(unsloth/utils/prefix_grouper.py, unsloth_zoo/rl_replacements.py, 2026.10.9) or ours (train/cpu_logprobs.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.memory.arch import Architecture
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.runtime import Runtime

UNSLOTH = "unsloth_prefix_grouper"
HF = "shared_prompt"
NONE = "none"
# the environment switches of Unsloth's PrefixGrouper and their defaults (tests read them back from the source)
PG_ENV = "UNSLOTH_GRPO_PREFIX_GROUPER"
PG_PACKING_ENV = "UNSLOTH_GRPO_SEQ_PACKING"
PG_TOKR_ENV = "UNSLOTH_GRPO_PREFIX_GROUPER_TOKR"
PG_VERIFY_ENV = "UNSLOTH_GRPO_PREFIX_GROUPER_VERIFY"
PG_TOKR_DEFAULT = 1.3
PG_OFF_VALUES = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Sharing:
    """`applies`: unsloth_prefix_grouper, shared_prompt or none; `available`: the backend's pass (what the figure
    "with prompt sharing" models); `verify`: Unsloth's self-verify keeps the full-row pass at the peak."""

    applies: str
    available: str
    reason: str
    verify: bool = False


def env_on(env: Mapping[str, str], name: str, default: str = "1") -> bool:
    """An Unsloth switch: anything but 0/false/no/off is on."""
    return env.get(name, default).lower() not in PG_OFF_VALUES


def token_ratio(prompt_len: int, completion_len: int, num_generations: int) -> float:
    """Unsloth's tok_r for full-length rows: G (P + C) / (P + G C)."""
    shared = prompt_len + num_generations * completion_len
    return num_generations * (prompt_len + completion_len) / shared if shared else 1.0


def _entropy_reason(extra: Mapping[str, Any]) -> str:
    quantile = extra.get("top_entropy_quantile", 1.0)
    coef = float(extra.get("entropy_coef", 0.0) or 0.0)
    if quantile is not None and quantile < 1.0:
        return f"train.top_entropy_quantile={quantile} needs per-token entropies, which PrefixGrouper does not compute"
    if coef != 0.0 and not extra.get("use_adaptive_entropy", False):
        return f"train.entropy_coef={coef} needs per-token entropies, which PrefixGrouper does not compute"
    return ""


def unsloth_prefix_grouper(arch: Architecture, *, fast_inference: bool, num_generations: int,
                           per_device_batch: int, generation_batch: int, prompt_len: int, completion_len: int,
                           extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Sharing:
    """Whether Unsloth's PrefixGrouper engages in the gradient pass, by its installed source's gates."""
    env = os.environ if env is None else env
    extra = extra or {}
    verify = env_on(env, PG_VERIFY_ENV)

    def off(reason: str) -> Sharing:
        return Sharing(NONE, UNSLOTH, f"Unsloth's PrefixGrouper does not engage: {reason}", verify)

    if not env_on(env, PG_ENV):
        return off(f"{PG_ENV}={env.get(PG_ENV)} turns it off")
    if not env_on(env, PG_PACKING_ENV):
        return off(f"it rides on sequence packing, which {PG_PACKING_ENV}={env.get(PG_PACKING_ENV)} turns off")
    if fast_inference:
        return off("it is off under vLLM (model.fast_inference)")
    if entropy := _entropy_reason(extra):
        return off(entropy)
    if num_generations < 2:
        return off("one completion per prompt leaves nothing to share")
    if arch.attn_softcapping or arch.moe or arch.ssm:
        kind = "attention soft-capping" if arch.attn_softcapping else "mixture-of-experts" if arch.moe else "Mamba"
        return off(f"the model has {kind} layers, which it skips")
    if not per_device_batch == generation_batch == num_generations:
        return off(f"TRL shuffles the {generation_batch} generated rows before the micro-batches of "
                   f"{per_device_batch}, and it needs each {num_generations} consecutive rows to share one prompt: "
                   "only a generation round of one group (per-device batch = generation batch = num_generations) "
                   "keeps that")
    window = arch.attention_window
    if window and prompt_len + completion_len > window:
        return off(f"prompt + completion ({prompt_len + completion_len}) exceeds the model's sliding window "
                   f"({window})")
    threshold = float(env.get(PG_TOKR_ENV, PG_TOKR_DEFAULT))
    ratio = token_ratio(prompt_len, completion_len, num_generations)
    if ratio < threshold:
        return off(f"its token ratio G(P+C)/(P+GC) = {ratio:.2f} is below its gate {threshold}")
    how = (f"token ratio {ratio:.2f} >= {threshold}; its first-use self-verify ({PG_VERIFY_ENV}=1) holds the "
           "full-row pass at the peak, so the peak is the full-row figure" if verify
           else f"token ratio {ratio:.2f} >= {threshold}, self-verify off ({PG_VERIFY_ENV}=0)")
    return Sharing(UNSLOTH, UNSLOTH, f"Unsloth's PrefixGrouper engages: {how}", verify)


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


def sharing_for(arch: Architecture, runtime: Runtime, recipe: Recipe,
                env: Mapping[str, str] | None = None) -> Sharing:
    """The shared-prompt pass a recipe's training forward gets with `runtime`."""
    t = recipe.train
    if runtime.backend == "unsloth":
        return unsloth_prefix_grouper(arch, fast_inference=runtime.fast_inference, num_generations=t.num_generations,
                                      per_device_batch=t.per_device_train_batch_size,
                                      generation_batch=runtime.generation_batch,
                                      prompt_len=recipe.data.max_prompt_length,
                                      completion_len=t.max_completion_length, extra=t.extra, env=env)
    return hf_shared_prompt(arch, shared_prompt=t.cpu.fast, num_generations=t.num_generations,
                            gradient_checkpointing=t.gradient_checkpointing, device=runtime.device)
