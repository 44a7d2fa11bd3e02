"""What this machine has (CUDA, the GPU, package versions: for doctor and env.json), and the ONE place where
the recipe's "auto" settings are resolved: backend, dtype, bf16/fp16 flags, optimizer, fast_inference.

Imports torch only inside the functions that need it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from typing import Any

PACKAGES = ["torch", "unsloth", "unsloth_zoo", "trl", "transformers", "peft", "bitsandbytes", "accelerate",
            "datasets", "vllm", "lowmem-grpo"]


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it; None when absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(module: str) -> bool:
    """Whether a module can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def describe() -> dict[str, Any]:
    """Python, platform, package versions, device and GPU memory, as plain data."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": "cpu",
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(device="cuda", gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_total_bytes=total, gpu_memory_free_bytes=free,
                    gpu_capability=f"{props.major}.{props.minor}", bf16_supported=torch.cuda.is_bf16_supported())
    return info


# --- the one place where "auto" settings are resolved ---------------------------------------------


def bf16_supported() -> bool:
    """Whether this machine's CUDA GPU computes in bfloat16 (False without CUDA)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_backend(requested: str, *, cuda: bool, processes: int = 1) -> str:
    """auto -> unsloth when CUDA and unsloth are both present and one process runs, else hf."""
    if requested != "auto":
        return requested
    if processes > 1:
        return "hf"
    return "unsloth" if cuda and is_installed("unsloth") else "hf"


def cpu_bf16_supported() -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 / AMX, as oneDNN reports it). Without it bf16 is
    emulated: measured ~50x slower than float32 for a GRPO step on an AVX2-only CPU."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(requested: str, *, cuda: bool) -> str:
    """Model dtype: auto -> bfloat16 on GPUs that support it, float16 on older GPUs; on CPU bfloat16 where the CPU
    has native bf16 (~1.9x faster than float32 there), else float32."""
    if requested != "auto":
        return requested
    if not cuda:
        return "bfloat16" if cpu_bf16_supported() else "float32"
    return "bfloat16" if bf16_supported() else "float16"


def precision_flags(precision: str, *, cuda: bool) -> dict[str, bool]:
    """GRPOConfig/SFTConfig bf16 and fp16 flags; TRL resolves bf16=None to True even on CPU, so both are set."""
    if precision == "auto":
        precision = "fp32" if not cuda else ("bf16" if bf16_supported() else "fp16")
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def resolve_optimizer(requested: str, *, cuda: bool) -> str:
    """auto -> paged_adamw_8bit on CUDA (bitsandbytes' 8-bit states), adamw_torch on CPU."""
    if requested != "auto":
        return requested
    return "paged_adamw_8bit" if cuda else "adamw_torch"


def resolve_fast_inference(requested: bool | None, *, cuda: bool) -> bool:
    """Unsloth's vLLM generation: None -> on when vLLM is installed and CUDA is present."""
    if requested is not None:
        return requested
    return cuda and is_installed("vllm")
