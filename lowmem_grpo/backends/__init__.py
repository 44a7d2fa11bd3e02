"""The one place that branches on Unsloth vs plain transformers: import it, load model + tokenizer, add LoRA.
Unsloth is imported first: it patches trl/transformers/peft and sets the CUDA allocator's configuration, which torch
reads once, when CUDA starts."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_grpo.backends.embedded import embedded_model_dir, is_embedded
from lowmem_grpo.combinations import check
from lowmem_grpo.device import CudaFacts, cuda_available, cuda_facts, is_installed, model_dtype, require_gpu
from lowmem_grpo.distributed import Launch, cuda_device_index
from lowmem_grpo.errors import BadInputError, LowmemError
from lowmem_grpo.recipe import AUTO, Recipe
from lowmem_grpo.runtime import CpuPaths, Runtime, before_cuda, check_loaded_dtype, place, resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model with its LoRA adapter attached, the Runtime it was loaded for, and the dtype it was loaded in."""

    model: Any
    tokenizer: Any
    runtime: Runtime
    model_path: str
    dtype: str
    """The dtype the model was really loaded in (Unsloth may load another than the Runtime asked for)."""

    @property
    def backend(self) -> str:
        return self.runtime.backend

    @property
    def device(self) -> str:
        return self.runtime.device


def start(recipe: Recipe, launch: Launch, facts: CudaFacts | Callable[[], CudaFacts] | None = None, *,
          training: bool = True, cpu: CpuPaths | None = None,
          vllm_room: Callable[[CudaFacts], bool] | None = None) -> tuple[Runtime, CudaFacts]:
    """The run's Runtime and CudaFacts, in the order CUDA needs: the recipe placed by what is known before CUDA
    starts (for `training`, refused combinations and a GPU recipe without a GPU stop here, exit 2), the backend
    imported, then the facts that start CUDA and the Runtime, resolved once, with them. `facts`: known facts, or the
    function that reads them. Without `training` the run is on whatever this machine has. `cpu`: the CPU speed paths
    instead of train.cpu.fast's. `vllm_room(facts)`: whether the memory plan fits vLLM's pool on this GPU, asked only
    where model.fast_inference=auto would turn vLLM on."""
    known = facts if isinstance(facts, CudaFacts) else None
    placed = place(recipe, launch, known or before_cuda(recipe, training), training=training)
    if training:
        check(recipe, placed)  # before anything is imported: what `lowmem-grpo validate` refuses
        if recipe.gpu_memory_gb and not (known.available if known else cuda_available()):
            require_gpu(recipe.gpu_memory_gb, known or cuda_facts())  # no GPU: reading the facts starts no CUDA
    prepare(placed.backend)
    known = known or (facts or cuda_facts)()
    require_gpu(recipe.gpu_memory_gb if training else None, known)  # e.g. a GPU this torch has no kernels for
    # the model loads where torch sees a GPU; facts a caller gives (a test's GPU) size the auto-fit only
    device = dataclasses.replace(known, available=known.available and cuda_available())
    ask = vllm_room is not None and placed.fast_inference and recipe.model.fast_inference == AUTO
    return resolve(recipe, launch, device, training=training, cpu=cpu,
                   vllm_room=vllm_room(known) if ask else None), known


def prepare(backend: str) -> None:
    """Import `backend` (unsloth or hf): Unsloth before anything imports trl/transformers/peft, so that it can patch
    them."""
    if backend == "unsloth":
        if not is_installed("unsloth"):
            raise BadInputError("model.backend=unsloth but unsloth is not installed",
                                fix="pip install unsloth, or set model.backend=hf")
        import unsloth  # noqa: F401  (import order matters: it patches transformers/trl/peft)
    elif backend != "hf":
        raise BadInputError(f"model.backend {backend!r} is unknown", fix="use auto, unsloth or hf")


def is_unsloth_model(model: Any) -> bool:
    """Whether `model` (or the model a PEFT wrapper holds) was loaded by Unsloth, which gives every model it loads
    `for_inference` / `for_training`."""
    return hasattr(model, "for_inference") and hasattr(model, "for_training")


def _hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1


def locate_model(name: str) -> str:
    """A local folder or hub id to load; embedded models are converted to a cached folder first."""
    if is_embedded(name):
        return str(embedded_model_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise BadInputError(f"model.name {name!r}: folder has no config.json",
                                fix="point model.name at a saved model folder or a hub id")
        return str(path)
    if not _hub_id(name):
        raise BadInputError(f"model.name {name!r}: no such folder", fix="check the path, or give a hub id like Org/Name")
    return name


def on_hub(name: str) -> bool:
    """Whether model.name names a hub model (neither embedded nor a local path): loading it asks the hub."""
    return not (is_embedded(name) or Path(name).expanduser().exists()) and _hub_id(name)


def present_target_modules(model: Any, wanted: list[str]) -> list[str]:
    """The wanted module names that exist in the model; an error when none do."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    present = [m for m in wanted if m in names]
    if not present:
        raise BadInputError(f"lora.target_modules {wanted} match no module of this model",
                            fix="name linear layers of the model, e.g. q_proj,v_proj")
    return present


def load(recipe: Recipe, runtime: Runtime, *, with_lora: bool = True, adapter_path: str | None = None,
         model_path: str | None = None) -> LoadedModel:
    """Load the recipe's model as `runtime` says and attach a fresh LoRA adapter, or load `adapter_path`: trainable
    with `with_lora` (lora.init_adapter, checked first by backends.adapter), frozen without. `model_path`: the
    located model.name (locate_model), when the caller has it."""
    path = model_path or locate_model(recipe.model.name)
    backend, dtype = runtime.backend, runtime.dtype
    if runtime.dtype_reason:
        log.info("model.dtype=auto -> %s: %s", dtype, runtime.dtype_reason)
    try:
        loader = _load_unsloth if backend == "unsloth" else _load_hf
        model, tokenizer = loader(recipe, path, runtime, with_lora, adapter_path)
    except OSError as exc:
        raise LowmemError(f"could not load model {recipe.model.name!r}: {exc}",
                          fix="check the hub id and network, or point model.name at a local folder") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = model_dtype(model)  # the bf16/fp16 flags follow what was loaded, not what was asked for
    if loaded != dtype:
        log.info("asked for %s, the model was loaded in %s (%s decides on this GPU)", dtype, loaded, backend)
    check_loaded_dtype(runtime, loaded)  # a precision Unsloth would refuse on it: exit 2, before any run dir
    log.info("loaded %s on %s (%s, %s, lora=%s)", path, runtime.device, backend, loaded, with_lora)
    return LoadedModel(model, tokenizer, runtime, path, loaded)


def nf4_config(compute_dtype: Any) -> Any:
    """bitsandbytes' 4-bit config: nf4 with double quantization (training's base)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def _load_hf(recipe: Recipe, path: str, runtime: Runtime, with_lora: bool, adapter_path: str | None
             ) -> tuple[Any, Any]:
    """Plain transformers + PEFT, the base quantized to nf4 on CUDA when asked: the backend that runs anywhere."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    m, lora, cuda = recipe.model, recipe.lora, runtime.cuda
    torch_dtype = getattr(torch, runtime.dtype)
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
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.train.gradient_checkpointing)
    if adapter_path and with_lora:  # a starting adapter (lora.init_adapter), trained further
        # its own (checked) LoraConfig with the recipe's dropout, as a resumed run trains, and this run's base recorded
        config = PeftConfig.from_pretrained(adapter_path)
        config.lora_dropout = recipe.lora.dropout
        config.base_model_name_or_path = path
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True, config=config), tokenizer
    if adapter_path:  # evaluation: frozen
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=False), tokenizer
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=present_target_modules(model, lora.target_modules))
    set_seed(recipe.train.seed)  # LoRA A is drawn from the global RNG, which torch seeds randomly per process
    return get_peft_model(model, config), tokenizer


def _load_unsloth(recipe: Recipe, path: str, runtime: Runtime, with_lora: bool, adapter_path: str | None
                  ) -> tuple[Any, Any]:
    """Unsloth's FastLanguageModel (its CPU fallback without a GPU), with its vLLM engine for fast_inference."""
    import torch
    from unsloth import FastLanguageModel

    m, lora = recipe.model, recipe.lora
    model, tokenizer = FastLanguageModel.from_pretrained(
        # evaluation (no with_lora): Unsloth loads the adapter on its base; training: the recipe's model
        model_name=path if with_lora else (adapter_path or path),
        max_seq_length=m.max_seq_length,
        # auto on CUDA: Unsloth picks (float16 below compute capability 8, float32 for the models it forces to it),
        # and the loaded dtype (lowmem_grpo.device.model_dtype) sets the bf16/fp16 flags
        dtype=None if runtime.cuda and m.dtype == "auto" else getattr(torch, runtime.dtype),
        load_in_4bit=m.load_in_4bit,
        fast_inference=runtime.fast_inference,
        max_lora_rank=lora.max_lora_rank or lora.r,
        gpu_memory_utilization=m.gpu_memory_utilization,
        trust_remote_code=m.trust_remote_code,
        random_state=recipe.train.seed,
    )
    if not with_lora:
        return model, tokenizer
    model = FastLanguageModel.get_peft_model(
        model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=present_target_modules(model, lora.target_modules),
        use_gradient_checkpointing="unsloth" if recipe.train.gradient_checkpointing else False,
        random_state=recipe.train.seed)
    if adapter_path:
        # a starting adapter's weights into the LoRA just built with the same (checked) shape, as transformers
        # resumes a PEFT checkpoint; not FastLanguageModel.from_pretrained(adapter), which loads the base the
        # adapter names instead of the recipe's resolved model
        result = model.load_adapter(adapter_path, adapter_name="default", is_trainable=True)
        stray = list(getattr(result, "unexpected_keys", []) or [])
        missing = list(getattr(result, "missing_keys", []) or [])
        if stray or missing:  # the shapes matched on paper, yet the tensors do not line up: say which
            raise BadInputError(f"lora.init_adapter {adapter_path}: its tensors do not fit this model's LoRA "
                                f"(unexpected {stray[:3]}, missing {missing[:3]})",
                                fix="give an adapter trained on this model with these target modules")
    return model, tokenizer
