"""Plain transformers + PEFT (+ bitsandbytes nf4 on CUDA): the backend that runs anywhere."""

from __future__ import annotations

from typing import Any

from lowmem_grpo.recipe import Recipe


def nf4_config(compute_dtype: Any) -> Any:
    """bitsandbytes' 4-bit config: nf4 with double quantization (training's base, and a merged-4bit export)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_hf(recipe: Recipe, path: str, dtype: str, cuda: bool, with_lora: bool,
            adapter_path: str | None) -> tuple[Any, Any]:
    """Model and tokenizer with a LoRA adapter, the base quantized to 4-bit on CUDA when asked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_grpo.backends import present_target_modules
    from lowmem_grpo.distributed import cuda_device_index

    m, lora = recipe.model, recipe.lora
    torch_dtype = getattr(torch, dtype)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": m.trust_remote_code}
    quantized = m.load_in_4bit and cuda  # bitsandbytes 4-bit training needs CUDA kernels
    if quantized:
        kwargs["quantization_config"] = nf4_config(torch_dtype)
        kwargs["device_map"] = {"": cuda_device_index()}  # this process's GPU: LOCAL_RANK under a launcher
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=m.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if cuda and not quantized:
        model = model.to(f"cuda:{cuda_device_index()}")
    if not (with_lora or adapter_path):
        return model, tokenizer
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.train.gradient_checkpointing)
    if adapter_path and with_lora:  # a starting adapter (lora.init_adapter), trained further
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True,
                                         config=trainable_config(adapter_path, recipe, path)), tokenizer
    if adapter_path:  # evaluation: frozen
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=False), tokenizer
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM",
        target_modules=present_target_modules(model, lora.target_modules),
    )
    from transformers import set_seed

    set_seed(recipe.train.seed)  # LoRA A is drawn from the global RNG, which torch seeds randomly per process
    return get_peft_model(model, config), tokenizer


def trainable_config(adapter_path: str, recipe: Recipe, path: str) -> Any:
    """The adapter's own LoraConfig (its shape, already checked against the recipe), with the recipe's dropout (a
    training setting, so that a resumed run, which builds a fresh LoRA from the recipe, trains the same way) and this
    run's base model recorded in the adapters it saves."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(adapter_path)
    config.lora_dropout = recipe.lora.dropout
    config.base_model_name_or_path = path
    return config
