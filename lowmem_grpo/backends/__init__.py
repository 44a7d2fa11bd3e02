"""The one place that branches on Unsloth vs plain transformers: load model + tokenizer, add LoRA.

Call `prepare(model.backend)` before anything imports trl/transformers/peft: it imports Unsloth first when
the run will use it, so that Unsloth can patch those libraries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_grpo.backends.embedded import embedded_model_dir, is_embedded
from lowmem_grpo.device import cpu_auto_dtype, is_installed, model_dtype, resolve_backend, resolve_dtype
from lowmem_grpo.distributed import world_size
from lowmem_grpo.errors import BadInputError, LowmemError

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model with its LoRA adapter attached, and what was chosen to load it."""

    model: Any
    tokenizer: Any
    backend: str
    device: str
    dtype: str
    """The dtype the model was really loaded in (lowmem_grpo.device.model_dtype), not the one asked for: Unsloth
    loads float16 on GPUs without native bfloat16 and float32 for the models it forces to it."""
    model_path: str


def prepare(requested: str) -> str:
    """The backend this run uses (`auto` resolved by lowmem_grpo.device), with Unsloth imported first when it is
    the one: call this before anything imports trl/transformers/peft."""
    import torch

    backend = resolve_backend(requested, cuda=torch.cuda.is_available(), processes=world_size())
    if requested == "auto":
        log.info("backend auto -> %s (cuda=%s, unsloth installed=%s, %d process(es))", backend,
                 torch.cuda.is_available(), is_installed("unsloth"), world_size())
    if backend == "unsloth":  # resolve_backend refused it under several processes, before this import
        if not is_installed("unsloth"):
            raise BadInputError("model.backend=unsloth but unsloth is not installed",
                                fix="pip install unsloth, or set model.backend=hf")
        import unsloth  # noqa: F401  (import order matters: it patches transformers/trl/peft)
    return backend


def is_unsloth_model(model: Any) -> bool:
    """Whether `model` (or the model a PEFT wrapper holds) was loaded by Unsloth: Unsloth gives every model it
    loads `for_inference` / `for_training`, which PEFT's wrappers pass through."""
    return hasattr(model, "for_inference") and hasattr(model, "for_training")


def resolve_model_path(name: str) -> str:
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
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1  # resolve_model_path's rule for a hub id


def present_target_modules(model: Any, wanted: list[str]) -> list[str]:
    """The wanted module names that exist in the model; an error when none do."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    present = [m for m in wanted if m in names]
    if not present:
        raise BadInputError(f"lora.target_modules {wanted} match no module of this model",
                            fix="name linear layers of the model, e.g. q_proj,v_proj")
    return present


def load(recipe: Any, backend: str, *, with_lora: bool = True, adapter_path: str | None = None,
         model_path: str | None = None) -> LoadedModel:
    """Load the recipe's model on `backend` and attach a fresh LoRA adapter, or load `adapter_path`: trainable as
    the starting LoRA with `with_lora` (lora.init_adapter, checked first by backends.adapter), frozen without.

    `model_path` is the already resolved `resolve_model_path(recipe.model.name)`, when the caller has it.
    """
    import torch

    cuda = torch.cuda.is_available()
    path = model_path or resolve_model_path(recipe.model.name)
    dtype = resolve_dtype(recipe.model.dtype, cuda=cuda)
    if recipe.model.dtype == "auto" and not cuda:
        log.info("model.dtype=auto -> %s: %s", dtype, cpu_auto_dtype().reason)
    try:
        if backend == "unsloth":
            from lowmem_grpo.backends.unsloth_backend import load_unsloth

            model, tokenizer = load_unsloth(recipe, path, dtype, cuda, with_lora, adapter_path)
        elif backend == "hf":
            from lowmem_grpo.backends.hf_backend import load_hf

            model, tokenizer = load_hf(recipe, path, dtype, cuda, with_lora, adapter_path)
        else:
            raise BadInputError(f"model.backend {backend!r} is unknown", fix="use auto, unsloth or hf")
    except OSError as exc:
        raise LowmemError(f"could not load model {recipe.model.name!r}: {exc}",
                          fix="check the hub id and network, or point model.name at a local folder") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = model_dtype(model)  # the bf16/fp16 flags follow what was loaded, not what was asked for
    if loaded != dtype:
        log.info("asked for %s, the model was loaded in %s (%s decides on this GPU)", dtype, loaded, backend)
    log.info("loaded %s on %s (%s, %s, lora=%s)", path, "cuda" if cuda else "cpu", backend, loaded, with_lora)
    return LoadedModel(model, tokenizer, backend, "cuda" if cuda else "cpu", loaded, path)
