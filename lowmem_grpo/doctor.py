"""`lowmem-grpo doctor`: the environment, the backend `auto` picks, and known-bad combinations."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version

from lowmem_grpo.device import describe, is_installed, package_version

# Distributions whose declared requirements must hold among the installed set.
CHECKED = ["unsloth", "unsloth_zoo", "trl", "peft", "accelerate", "bitsandbytes", "torchvision"]


def requirement_conflicts() -> list[str]:
    """Installed versions that break a declared requirement of a key package (like `pip check`)."""
    problems = []
    for dist_name in CHECKED:
        try:
            requires = importlib.metadata.requires(dist_name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            installed = package_version(req.name)
            if installed and req.specifier and not req.specifier.contains(Version(installed), prereleases=True):
                problems.append(f"{dist_name} {package_version(dist_name)} needs {req}, found {req.name} {installed}")
    return problems


def torchvision_loads() -> str | None:
    """torchvision's compiled ops fail against a torch they were not built for; Unsloth then fails to import."""
    if not is_installed("torchvision"):
        return None
    code = "import torchvision, torch; torch.ops.torchvision.nms"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
    return (f"torchvision {package_version('torchvision')} does not load with torch {package_version('torch')} "
            f"({last}); install the pinned pair from constraints.txt")


def report() -> tuple[str, list[str]]:
    """Doctor's text and the list of problems found."""
    info = describe()
    lines = [f"python        {info['python']} ({info['platform']})"]
    for name, version in info["packages"].items():
        lines.append(f"{name:<13} {version or 'not installed'}")
    lines.append(f"torch CUDA    build {info['torch_cuda_build'] or 'none'}, available={info['cuda_available']}")
    if info["cuda_available"]:
        lines.append(f"GPU           {info['gpu_name']} x{info['gpu_count']}, "
                     f"{info['gpu_memory_total_bytes'] / 2**30:.1f} GiB, capability {info['gpu_capability']}, "
                     f"bf16={info['bf16_supported']}")
    else:
        lines.append(f"GPU           none (CPU, {info['cpu_threads']} threads)")
    auto = "unsloth" if info["cuda_available"] and is_installed("unsloth") else "hf"
    lines.append(f"backend auto  -> {auto}")
    problems = requirement_conflicts()
    tv = torchvision_loads()
    if tv:
        problems.append(tv)
    if is_installed("vllm") and not info["cuda_available"]:
        problems.append("vllm is installed but there is no CUDA device: fast_inference stays off")
    lines.append("problems      " + ("none" if not problems else ""))
    lines.extend(f"  - {p}" for p in problems)
    return "\n".join(lines) + "\n", problems
