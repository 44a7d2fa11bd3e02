"""What this machine has: CUDA, the GPU, bf16 support and package versions (for doctor and env.json)."""

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
