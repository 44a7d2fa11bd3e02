"""The one entry for sampling completions of rendered prompts: vLLM when the model has a vLLM engine, else the
sampling engine in inference mode on a private RNG stream."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.backends import is_unsloth_model
from lowmem_grpo.sampling.attention import cpu_attention
from lowmem_grpo.errors import BadInputError


@dataclass
class Generation:
    """One completion: its text (prefill excluded), token count, whether it was cut, and the calculator's tokens."""

    text: str
    tokens: int
    truncated: bool
    forced_tokens: int = 0


LIVE_ADAPTER = "lowmem_grpo_live_lora"
"""The name of the adapter being trained as handed to Unsloth's vLLM engine (which keeps the base weights)."""


def vllm_engine_of(model: Any) -> Any:
    """A vllm.LLM itself, or Unsloth's `model.vllm_engine` (not `fast_generate`, which every Unsloth model has)."""
    if type(model).__module__.split(".")[0] == "vllm":
        return model
    return getattr(model, "vllm_engine", None)


def live_adapter_request(model: Any) -> Any:
    """A LoRARequest for the adapter as it is now (Unsloth's engine holds the base weights); None without one."""
    load = getattr(model, "load_lora", None)
    if load is None or not hasattr(model, "peft_config"):
        return None
    return load(LIVE_ADAPTER, load_tensors=True)


def vllm_target(model: Any, lora_request: Any = None) -> tuple[Any, Any]:
    """(engine, LoRA request) to generate with: the given request, else the model's live adapter."""
    return vllm_engine_of(model), lora_request if lora_request is not None else live_adapter_request(model)


def choose_engine(model: Any, engine: str = "auto") -> str:
    """auto -> vllm when the model has a vLLM engine (vllm_engine_of), else transformers."""
    if engine not in ("auto", "vllm", "transformers"):
        raise BadInputError(f"engine {engine!r} is unknown", fix="use auto, vllm or transformers")
    if engine == "auto":
        return "vllm" if vllm_engine_of(model) is not None else "transformers"
    if engine == "vllm" and vllm_engine_of(model) is None:
        raise BadInputError("engine vllm needs a vLLM engine as the model (a vllm.LLM, or a model loaded with "
                            "model.fast_inference=true)", fix="use engine=transformers or auto")
    return engine


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end an answer: the generation_config's eos ids and the tokenizer's (as generate's)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(configured) if isinstance(configured, (list, tuple)) else {configured}
    return (ids | {tokenizer.eos_token_id}) - {None}


def _required_eos(model: Any, tokenizer: Any) -> set[int]:
    eos = eos_ids(model, tokenizer)
    if not eos:
        raise BadInputError("the tokenizer has no EOS token, so truncation cannot be told from an end",
                            fix="set tokenizer.eos_token (and the model's generation_config.eos_token_id)")
    return eos


def _grouped(tokenizer: Any, rows: list[Any], eos: set[int], num_samples: int) -> list[list[Generation]]:
    """Sampled rows as Generations, num_samples per prompt; a final EOS is left out of the text."""
    out = []
    for r in rows:
        kept = r.ids[:-1] if not r.truncated and r.ids and r.ids[-1] in eos else r.ids
        out.append(Generation(tokenizer.decode(kept, skip_special_tokens=True), len(r.ids), r.truncated, sum(r.forced)))
    return [out[i:i + num_samples] for i in range(0, len(out), num_samples)]


@dataclass
class MergeResult:
    """How many LoRA layers merged_adapter merged (0 = none), and why not when it could not."""

    layers: int
    reason: str = ""

    def describe(self) -> str:
        if self.layers:
            return f"sampling from merged LoRA weights ({self.layers} layers; train.cpu.fast)"
        return f"sampling through the unmerged LoRA adapter: {self.reason}"


def _merge_problem(module: Any, lora_linear: type, linear: type, identity: type) -> str:
    """Why this PEFT LoRA layer cannot be sampled from merged weights exactly ("" when it can)."""
    if type(module) is not lora_linear or type(module.base_layer) is not linear:
        return f"{type(module).__name__} over {type(module.base_layer).__name__} is not a plain LoRA Linear"
    if module.base_layer.weight.device.type != "cpu":
        return "the weights are on a GPU, where the merged copy would cost memory the planner does not count"
    if module._forward_hooks or module._forward_pre_hooks or module.base_layer._forward_hooks \
            or module.base_layer._forward_pre_hooks:
        return "a LoRA layer carries forward hooks"
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in module.lora_variant or module.lora_bias[name] or module.fan_in_fan_out:
            return f"adapter {name!r} is not vanilla LoRA (DoRA or another variant, a LoRA bias, or fan_in_fan_out)"
        dropout = module.lora_dropout[name]
        if not isinstance(dropout, identity) and dropout.training and dropout.p > 0:
            return (f"LoRA dropout {dropout.p} is active while sampling (the model is in training mode), and a merged "
                    "weight cannot drop the adapter's inputs")
    return ""


@contextlib.contextmanager
def merged_adapter(model: Any, enabled: bool = True) -> Iterator[MergeResult]:
    """Every LoRA Linear swapped for a Linear of the merged weight while the block runs (docs/performance.md): all or
    none, on CPU, plain LoRA without dropout; otherwise the model is left as it is."""
    if not enabled or is_unsloth_model(model):
        yield MergeResult(0, "an Unsloth model samples through its own fused LoRA kernels" if enabled else "off")
        return
    import torch
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, BaseTunerLayer)]
    if not found or any(m.disable_adapters or m.merged for _, _, m in found):
        reason = "no LoRA layers, or their adapters are disabled or already merged"
    else:
        reason = next(filter(None, (_merge_problem(m, LoraLinear, torch.nn.Linear, torch.nn.Identity)
                                    for _, _, m in found)), "")
    if reason:
        yield MergeResult(0, reason)
        return
    swaps = []
    with torch.no_grad():
        for parent, name, module in found:
            base = module.base_layer
            weight = base.weight.float()  # the delta added in float32, cast once
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight.addmm(module.lora_B[adapter].weight.float(), module.lora_A[adapter].weight.float(),
                                          alpha=module.scaling[adapter])
            merged = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            merged.weight = torch.nn.Parameter(weight.to(base.weight.dtype), requires_grad=False)
            merged.bias = base.bias
            merged.train(module.training)
            swaps.append((parent, name, module, merged))
    try:
        for parent, name, _, merged in swaps:
            setattr(parent, name, merged)
        yield MergeResult(len(swaps))
    finally:
        for parent, name, module, _ in swaps:
            setattr(parent, name, module)


@contextlib.contextmanager
def fast_sampling(model: Any, merged: bool = True, attention: bool = True) -> Iterator[MergeResult]:
    """merged_adapter and cpu_attention together, as every transformers sampling path runs; yields the merge."""
    with merged_adapter(model, merged) as result, cpu_attention(model, attention):
        yield result


@contextlib.contextmanager
def inference_mode(model: Any) -> Iterator[None]:
    """The model in inference mode, then back; Unsloth's through for_inference / for_training, which also switch
    gradient checkpointing."""
    was_training = model.training
    unsloth = is_unsloth_model(model)
    checkpointing = getattr(model, "_unsloth_gradient_checkpointing", None)
    if unsloth:
        model.for_inference()
    else:
        model.eval()
    try:
        yield
    finally:
        if was_training and unsloth:
            model.for_training(use_gradient_checkpointing=checkpointing)
        elif was_training:
            model.train()


def _generate_vllm(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int, num_samples: int,
                   temperature: float, seed: int, lora_request: Any, calculator: bool,
                   params_class: Callable[..., Any] | None) -> list[list[Generation]]:
    """vLLM generation; with the calculator in rounds over the prompts' token ids, every row seeded from `seed`."""
    engine, request = vllm_target(model, lora_request)
    settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1 if temperature else 1}
    if not calculator:
        from vllm import SamplingParams

        params = SamplingParams(n=num_samples, **settings, max_tokens=max_new_tokens, seed=seed)
        outputs = engine.generate(prompts, sampling_params=params, lora_request=request, use_tqdm=False)
        return [[Generation(text=o.text, tokens=len(o.token_ids), truncated=o.finish_reason == "length")
                 for o in out.outputs] for out in outputs]
    from lowmem_grpo.sampling.engine import Calculator
    from lowmem_grpo.sampling.vllm_calculator import EngineRounds, calculator_rows

    eos = _required_eos(model, tokenizer)
    ids = tokenizer(prompts)["input_ids"]
    rows = calculator_rows(EngineRounds(engine, settings, request, params_class),
                           [p for p in ids for _ in range(num_samples)], max_tokens=max_new_tokens,
                           calculator=Calculator(tokenizer), eos_ids=eos, seed=seed)
    return _grouped(tokenizer, rows, eos, num_samples)


def generate(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 256, batch_size: int = 8,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0, progress: bool = True,
             engine: str = "auto", lora_request: Any = None, desc: str = "eval",
             merged: bool = True, calculator: bool = False, attention: bool = True,
             on_progress: Callable[[int, int], None] | None = None,
             sampling_params_class: Callable[..., Any] | None = None) -> list[list[Generation]]:
    """num_samples completions per prompt: on vLLM from `lora_request` (else the live adapter), else through the
    engine inside fast_sampling. `on_progress(done, total)` runs after each batch (vLLM: once)."""
    if max_new_tokens < 1 or batch_size < 1 or num_samples < 1:
        raise BadInputError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}, num_samples={num_samples}:"
                            " each must be at least 1", fix="use positive values")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise BadInputError(f"temperature={temperature} must be >= 0", fix="use 0 for greedy or e.g. 0.7")
    if num_samples > 1 and temperature == 0:
        raise BadInputError(f"{num_samples} samples per problem at temperature 0 would all be the same greedy text",
                            fix="set a sampling temperature (e.g. --temperature 0.7) or use 1 sample")
    from tqdm.auto import tqdm

    chosen = choose_engine(model, engine)
    with tqdm(total=len(prompts), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True) as bar:
        if chosen == "vllm":
            out = _generate_vllm(model, tokenizer, prompts, max_new_tokens=max_new_tokens, num_samples=num_samples,
                                 temperature=temperature, seed=seed, lora_request=lora_request,
                                 calculator=calculator, params_class=sampling_params_class)
            bar.update(len(prompts))
            if on_progress is not None:
                on_progress(len(prompts), len(prompts))
            return out
        import torch

        from lowmem_grpo.sampling.engine import Calculator, sample_rows

        eos = _required_eos(model, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        tool = Calculator(tokenizer) if calculator else None
        device = next(model.parameters()).device
        per_batch = max(1, batch_size // num_samples)  # batch_size counts sequences generated at once
        results: list[list[Generation]] = []
        # a private RNG stream: repeatable samples without touching the one training's sampling and dropout draw from
        devices = [device.index or 0] if device.type == "cuda" else []
        with inference_mode(model), fast_sampling(model, merged, attention), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), per_batch):
                batch = prompts[start:start + per_batch]
                rows = sample_rows(model, [p for p in tokenizer(batch)["input_ids"] for _ in range(num_samples)],
                                   max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos, pad_id=pad_id,
                                   calculator=tool)
                results += _grouped(tokenizer, rows, eos, num_samples)
                bar.update(len(batch))
                if on_progress is not None:
                    on_progress(len(results), len(prompts))
    return results
