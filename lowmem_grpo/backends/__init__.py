"""The one place that branches on Unsloth vs plain transformers: import it, load model + tokenizer, add LoRA.

`start` resolves a run's Runtime with the backend imported first: Unsloth patches trl/transformers/peft, and its
import sets the CUDA allocator's configuration (PYTORCH_ALLOC_CONF=expandable_segments:True, unsloth_zoo/__init__.py),
which torch reads once, when CUDA starts.
"""

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
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError, LowmemError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.runtime import Runtime, before_cuda, resolve

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model with its LoRA adapter attached, and the Runtime it was loaded for."""

    model: Any
    tokenizer: Any
    runtime: Runtime
    """The run's Runtime, with the dtype the model was really loaded in (lowmem_grpo.device.model_dtype), not the
    one asked for: Unsloth loads float16 on GPUs without native bfloat16 and float32 for the models it forces to it."""
    model_path: str

    @property
    def backend(self) -> str:
        """unsloth or hf."""
        return self.runtime.backend

    @property
    def device(self) -> str:
        """cuda or cpu."""
        return self.runtime.device

    @property
    def dtype(self) -> str:
        """The dtype the model was really loaded in."""
        return self.runtime.dtype


def start(recipe: Recipe, launch: Launch, facts: CudaFacts | Callable[[], CudaFacts] | None = None, *,
          training: bool = True) -> tuple[Runtime, CudaFacts]:
    """The run's Runtime and this machine's CudaFacts, in the order CUDA needs. First the Runtime from what is known
    before CUDA starts (whether torch sees a GPU: lowmem_grpo.runtime.before_cuda), and for `training` every
    combination it could not honour refused (lowmem_grpo.combinations.check) and a GPU recipe without a usable GPU
    stopped (exit 2); then the backend imported (Unsloth sets the allocator configuration torch reads when CUDA
    starts); only then the facts that start CUDA, and the Runtime again with the GPU's compute capability (the
    dtype `auto` loads on CUDA). `facts`: known facts (a test's), or the function that reads them (default
    lowmem_grpo.device.cuda_facts). Without `training` (an evaluation, the preflight) the run is on whatever this
    machine has."""
    known = facts if isinstance(facts, CudaFacts) else None
    runtime = resolve(recipe, launch, known or before_cuda(recipe, training), training=training)
    if training:
        check(recipe, runtime)  # before anything is imported: what `lowmem-grpo validate` refuses
        if recipe.gpu_memory_gb and not (known.available if known else cuda_available()):
            require_gpu(recipe.gpu_memory_gb, known or cuda_facts())  # no GPU: reading the facts starts no CUDA
    prepare(runtime.backend)
    known = known or (facts or cuda_facts)()
    require_gpu(recipe.gpu_memory_gb if training else None, known)  # e.g. a GPU this torch has no kernels for
    # the model loads where torch sees a GPU; facts a caller gives (a test's GPU) size the auto-fit only
    device = dataclasses.replace(known, available=known.available and cuda_available())
    return resolve(recipe, launch, device, training=training), known


def prepare(backend: str) -> str:
    """Import `backend` (unsloth or hf, as resolved by lowmem_grpo.runtime) for the run: Unsloth first, before
    anything imports trl/transformers/peft, so that it can patch them. Returns `backend`."""
    if backend == "unsloth":
        if not is_installed("unsloth"):
            raise BadInputError("model.backend=unsloth but unsloth is not installed",
                                fix="pip install unsloth, or set model.backend=hf")
        import unsloth  # noqa: F401  (import order matters: it patches transformers/trl/peft)
    elif backend != "hf":
        raise BadInputError(f"model.backend {backend!r} is unknown", fix="use auto, unsloth or hf")
    return backend


def is_unsloth_model(model: Any) -> bool:
    """Whether `model` (or the model a PEFT wrapper holds) was loaded by Unsloth: Unsloth gives every model it
    loads `for_inference` / `for_training`, which PEFT's wrappers pass through."""
    return hasattr(model, "for_inference") and hasattr(model, "for_training")


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
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise BadInputError(f"model.name {name!r}: no such folder", fix="check the path, or give a hub id like Org/Name")
    return name


def on_hub(name: str) -> bool:
    """Whether model.name names a hub model (neither embedded nor a local path): loading it asks the hub."""
    if is_embedded(name) or Path(name).expanduser().exists():
        return False
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1  # locate_model's rule for a hub id


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
    """Load the recipe's model as `runtime` says (backend, device, dtype) and attach a fresh LoRA adapter, or load
    `adapter_path`: trainable as the starting LoRA with `with_lora` (lora.init_adapter, checked first by
    backends.adapter), frozen without. The LoadedModel's Runtime has the dtype the model was really loaded in.

    `model_path` is the already located `locate_model(recipe.model.name)`, when the caller has it.
    """
    path = model_path or locate_model(recipe.model.name)
    backend, dtype, cuda = runtime.backend, runtime.dtype, runtime.cuda
    if runtime.dtype_reason:
        log.info("model.dtype=auto -> %s: %s", dtype, runtime.dtype_reason)
    try:
        if backend == "unsloth":
            from lowmem_grpo.backends.unsloth_backend import load_unsloth

            model, tokenizer = load_unsloth(recipe, path, dtype, cuda, with_lora, adapter_path,
                                            fast_inference=runtime.fast_inference)
        else:
            from lowmem_grpo.backends.hf_backend import load_hf

            model, tokenizer = load_hf(recipe, path, dtype, cuda, with_lora, adapter_path)
    except OSError as exc:
        raise LowmemError(f"could not load model {recipe.model.name!r}: {exc}",
                          fix="check the hub id and network, or point model.name at a local folder") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = model_dtype(model)  # the bf16/fp16 flags follow what was loaded, not what was asked for
    if loaded != dtype:
        log.info("asked for %s, the model was loaded in %s (%s decides on this GPU)", dtype, loaded, backend)
    log.info("loaded %s on %s (%s, %s, lora=%s)", path, runtime.device, backend, loaded, with_lora)
    return LoadedModel(model, tokenizer, runtime.loaded(loaded), path)
