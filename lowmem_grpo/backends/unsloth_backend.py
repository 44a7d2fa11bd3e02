"""Unsloth's FastLanguageModel: 4-bit loading, fast LoRA kernels, optional vLLM generation."""

from __future__ import annotations

from typing import Any

from lowmem_grpo.device import resolve_fast_inference


def load_unsloth(recipe: Any, path: str, dtype: str, cuda: bool, with_lora: bool,
                 adapter_path: str | None) -> tuple[Any, Any]:
    """Model and tokenizer through Unsloth (its CPU fallback when there is no GPU)."""
    import torch
    from unsloth import FastLanguageModel

    m, lora = recipe.model, recipe.lora
    fast_inference = resolve_fast_inference(m.fast_inference, cuda=cuda)
    max_rank = lora.max_lora_rank or lora.r
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=adapter_path or path,
        max_seq_length=m.max_seq_length,
        dtype=getattr(torch, dtype),
        load_in_4bit=m.load_in_4bit,
        fast_inference=fast_inference,
        max_lora_rank=max_rank,
        gpu_memory_utilization=m.gpu_memory_utilization,
        trust_remote_code=m.trust_remote_code,
        random_state=recipe.train.seed,
    )
    if adapter_path or not with_lora:
        return model, tokenizer
    from lowmem_grpo.backends import present_target_modules

    model = FastLanguageModel.get_peft_model(
        model,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=present_target_modules(model, lora.target_modules),
        use_gradient_checkpointing="unsloth" if recipe.train.gradient_checkpointing else False,
        random_state=recipe.train.seed,
    )
    return model, tokenizer
