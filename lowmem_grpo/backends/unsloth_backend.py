"""Unsloth's FastLanguageModel: 4-bit loading, fast LoRA kernels, optional vLLM generation."""

from __future__ import annotations

from typing import Any

from lowmem_grpo.recipe import Recipe


def load_unsloth(recipe: Recipe, path: str, dtype: str, cuda: bool, with_lora: bool,
                 adapter_path: str | None, *, fast_inference: bool = False) -> tuple[Any, Any]:
    """Model and tokenizer through Unsloth (its CPU fallback when there is no GPU); `fast_inference`: Unsloth's
    vLLM engine (Runtime.fast_inference)."""
    import torch
    from unsloth import FastLanguageModel

    m, lora = recipe.model, recipe.lora
    max_rank = lora.max_lora_rank or lora.r
    model, tokenizer = FastLanguageModel.from_pretrained(
        # evaluation (no with_lora): Unsloth loads the adapter on its base; training: the recipe's model
        model_name=path if with_lora else (adapter_path or path),
        max_seq_length=m.max_seq_length,
        # auto on CUDA: Unsloth picks (float16 below compute capability 8, its own rule for the models it forces
        # to float32), and the loaded dtype (lowmem_grpo.device.model_dtype) sets the bf16/fp16 flags
        dtype=None if cuda and m.dtype == "auto" else getattr(torch, dtype),
        load_in_4bit=m.load_in_4bit,
        fast_inference=fast_inference,
        max_lora_rank=max_rank,
        gpu_memory_utilization=m.gpu_memory_utilization,
        trust_remote_code=m.trust_remote_code,
        random_state=recipe.train.seed,
    )
    if not with_lora:
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
    if adapter_path:  # a starting adapter (lora.init_adapter): its weights into the LoRA just built
        load_start_weights(model, adapter_path)
    return model, tokenizer


def load_start_weights(model: Any, adapter_path: str) -> None:
    """Copy a starting adapter's weights into the LoRA that get_peft_model just built with the recipe's (checked,
    equal) rank, alpha and modules, as transformers does when it resumes a PEFT checkpoint.

    Not `FastLanguageModel.from_pretrained(adapter folder)`: that loads the base the adapter names (another
    machine's path, or another upload of the model) instead of the recipe's resolved model.
    """
    from lowmem_grpo.errors import BadInputError

    result = model.load_adapter(adapter_path, adapter_name="default", is_trainable=True)
    stray = list(getattr(result, "unexpected_keys", []) or [])
    missing = list(getattr(result, "missing_keys", []) or [])
    if stray or missing:  # the shapes matched on paper, yet the tensors do not line up: say which
        raise BadInputError(f"lora.init_adapter {adapter_path}: its tensors do not fit this model's LoRA "
                            f"(unexpected {stray[:3]}, missing {missing[:3]})",
                            fix="give an adapter trained on this model with these target modules")
