"""Finding llama.cpp's converter of the installed llama-cpp-python (lowmem_grpo.export.converter), on source
distributions built here with the registry's layout: what is kept, what is checked, what is refused, and that a
kept converter is found again without fetching. No network: the fetch is a local folder of files."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.export.converter import (BINDINGS, CONVERTER, KNOWN_SDISTS, SOURCE_FILE, InstalledRuntime,
                                          cache_root, download_sdist, find_converter, main, prefix_root,
                                          unpack_converter)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_sdist(folder: Path, version: str = "9.9.9", *, bindings: bytes = b"# bindings\n", extra=(),
                drop: tuple[str, ...] = (), name: str = "llama_cpp_python") -> Path:
    """A llama_cpp_python-VERSION.tar.gz laid out as the registry's: PKG-INFO, the llama_cpp package, llama.cpp under
    vendor/ (the converter, conversion/, gguf-py/, LICENSE and sources the converter does not need), the submodule's
    HEAD. `extra`: more (TarInfo, bytes) members; `drop`: member paths left out."""
    top = f"llama_cpp_python-{version}"
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        "llama_cpp/__init__.py": f'__version__ = "{version}"\n'.encode(),
        "llama_cpp/llama_cpp.py": bindings,
        "vendor/llama.cpp/convert_hf_to_gguf.py": b"import conversion\n",
        "vendor/llama.cpp/LICENSE": b"MIT\n",
        "vendor/llama.cpp/conversion/__init__.py": b"",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": b"",
        "vendor/llama.cpp/convert_lora_to_gguf.py": b"",
        "vendor/llama.cpp/ggml/src/ggml.c": b"int main(void) { return 0; }\n",
        ".git/modules/vendor/llama.cpp/HEAD": (COMMIT + "\n").encode(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, data in files.items():
            if rel not in drop:
                info = tarfile.TarInfo(f"{top}/{rel}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def runtime_of(version: str = "9.9.9", bindings: bytes = b"# bindings\n") -> InstalledRuntime:
    """The InstalledRuntime an install built from build_sdist(version, bindings=...) has."""
    files = {"llama_cpp/__init__.py": f'__version__ = "{version}"\n'.encode(), "llama_cpp/llama_cpp.py": bindings}
    return InstalledRuntime(version, {n: hashlib.sha256(files[n]).hexdigest() for n in BINDINGS})


class LocalIndex:
    """Stands in for converter.download_sdist(version, dest) -> Path: the llama_cpp_python-VERSION.tar.gz of its
    folder copied into dest, BadInputError when it has none (as pip's failure is); records the versions asked."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.asked = folder, []

    def __call__(self, version: str, dest: Path) -> Path:
        self.asked.append(version)
        found = self.folder / f"llama_cpp_python-{version}.tar.gz"
        if not found.is_file():
            raise BadInputError(f"pip could not fetch llama-cpp-python {version}'s", fix="pass --llama-cpp FILE")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(found, dest / found.name))


@pytest.fixture
def places(tmp_path):
    """An environment without a kept converter: (environ, prefix, index folder)."""
    return {"LOWMEM_GRPO_CACHE": str(tmp_path / "cache")}, tmp_path / "prefix", tmp_path / "index"


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_the_installed_versions_converter_is_fetched_once_unpacked_alone_and_recorded(places):
    environ, prefix, index = places
    build_sdist(index)
    fetch = LocalIndex(index)
    script = find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=fetch)
    folder = cache_root(environ) / "9.9.9"
    assert script == folder / CONVERTER and fetch.asked == ["9.9.9"]
    kept = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert kept == sorted([SOURCE_FILE, "LICENSE", "conversion/__init__.py", CONVERTER, "gguf-py/gguf/__init__.py"])
    record = json.loads((folder / SOURCE_FILE).read_text())
    sdist = index / "llama_cpp_python-9.9.9.tar.gz"
    assert record["version"] == "9.9.9" and record["llama_cpp_commit"] == COMMIT and record["files"] == 4
    assert record["sdist_sha256"] == hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert record["bindings"] == runtime_of().bindings
    # found again without fetching, in a cache with nothing else in it
    again = LocalIndex(index)
    assert find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=again) == script
    assert again.asked == [] and leftovers(cache_root(environ)) == ["9.9.9"]


def test_a_converter_kept_beside_the_environment_comes_first(places):
    environ, prefix, index = places
    kept = unpack_converter(build_sdist(index), runtime_of(), prefix_root(prefix))
    fetch = LocalIndex(index)
    assert find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=fetch) == kept
    assert fetch.asked == [] and not cache_root(environ).exists()


def test_a_converter_kept_by_one_user_is_readable_by_the_others(places):
    """An image built as root keeps the converter for the image's user: the kept folder and files get the modes
    the umask gives anything else made there (022: world-readable), not a temporary folder's 0700."""
    import os
    import stat

    environ, prefix, index = places
    umask = os.umask(0o022)
    try:
        kept = unpack_converter(build_sdist(index), runtime_of(), prefix_root(prefix))
    finally:
        os.umask(umask)
    for path in [kept.parent, *kept.parent.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o044 and (not path.is_dir() or mode & 0o011 == 0o011), (path, oct(mode))


def test_another_build_of_the_same_version_is_not_served_a_kept_converter(places):
    """A kept converter serves only the runtime whose bindings it recorded; the registry's file does not match a
    runtime built from other sources, which is refused naming the fix."""
    environ, prefix, index = places
    build_sdist(index)
    find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=LocalIndex(index))
    other = runtime_of(bindings=b"# a fork's bindings\n")
    fetch = LocalIndex(index)
    with pytest.raises(BadInputError, match="llama_cpp/llama_cpp.py differ from the installed") as refused:
        find_converter(runtime=other, environ=environ, prefix=prefix, fetch=fetch)
    assert fetch.asked == ["9.9.9"] and "--llama-cpp" in refused.value.fix
    assert leftovers(cache_root(environ)) == ["9.9.9"]  # the first one stays, nothing partial beside it


@pytest.mark.parametrize("case, message", [
    ("version", "is llama-cpp-python 9.9.9, the installed runtime is 9.9.8"),
    ("name", "is not llama-cpp-python"),
    ("converter", "has no convert_hf_to_gguf.py under vendor/llama.cpp/"),
    ("gguf-py", "has no gguf-py"),
])
def test_a_source_that_is_not_the_runtimes_is_refused_and_leaves_nothing(places, case, message):
    environ, prefix, index = places
    if case == "version":  # the file of 9.9.9 served for 9.9.8
        build_sdist(index).rename(index / "llama_cpp_python-9.9.8.tar.gz")
        runtime = runtime_of("9.9.8")
    else:
        drop = {"converter": ("vendor/llama.cpp/convert_hf_to_gguf.py",),
                "gguf-py": ("vendor/llama.cpp/gguf-py/gguf/__init__.py",)}.get(case, ())
        build_sdist(index, name="something_else" if case == "name" else "llama_cpp_python", drop=drop)
        runtime = runtime_of()
    with pytest.raises(BadInputError, match=message):
        find_converter(runtime=runtime, environ=environ, prefix=prefix, fetch=LocalIndex(index))
    assert leftovers(cache_root(environ)) == []


def test_the_pinned_versions_file_must_have_the_registrys_sha256(places):
    environ, prefix, index = places
    build_sdist(index, version="0.3.36")
    with pytest.raises(BadInputError, match=f"is not that of the registry's llama-cpp-python 0.3.36 source "
                                            f"distribution \\({KNOWN_SDISTS['0.3.36']}\\)"):
        find_converter(runtime=runtime_of("0.3.36"), environ=environ, prefix=prefix, fetch=LocalIndex(index))
    assert leftovers(cache_root(environ)) == []


def test_unsafe_members_are_refused(places):
    environ, prefix, index = places
    escape = tarfile.TarInfo("llama_cpp_python-9.9.9/../../evil.py")
    escape.size = 1
    build_sdist(index, extra=[(escape, b"x")])
    with pytest.raises(BadInputError, match="unsafe path"):
        find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=LocalIndex(index))
    link = tarfile.TarInfo("llama_cpp_python-9.9.9/vendor/llama.cpp/gguf-py/gguf/link.py")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    build_sdist(index, extra=[(link, None)])
    with pytest.raises(BadInputError, match="is a link, not a file"):
        find_converter(runtime=runtime_of(), environ=environ, prefix=prefix, fetch=LocalIndex(index))
    assert leftovers(cache_root(environ)) == [] and not (index.parent / "evil.py").exists()


def test_llama_cpp_names_a_folder_a_script_or_a_source_distribution(places, tmp_path):
    environ, prefix, index = places
    sdist = build_sdist(index)
    never = LocalIndex(tmp_path / "nothing")
    from_file = find_converter(sdist, runtime=runtime_of(), environ=environ, prefix=prefix, fetch=never)
    assert from_file == cache_root(environ) / "9.9.9" / CONVERTER and never.asked == []
    folder = from_file.parent
    assert find_converter(folder, runtime=runtime_of(), environ=environ, fetch=never) == from_file
    assert find_converter(environ={**environ, "LLAMA_CPP_DIR": str(from_file)}, runtime=runtime_of(),
                          fetch=never) == from_file
    empty = tmp_path / "llama.cpp"
    empty.mkdir()
    with pytest.raises(BadInputError, match=f"no {CONVERTER} at {empty}"):
        find_converter(environ={**environ, "LLAMA_CPP_DIR": str(empty)}, runtime=runtime_of(), fetch=never)


def runtime_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is None


def test_a_fetch_that_fails_names_the_offline_fix(tmp_path):
    """pip itself, with an index that has nothing: the error says what to download where and how to pass it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInputError, match="pip could not fetch llama-cpp-python 9.9.9's") as failed:
        download_sdist("9.9.9", tmp_path / "dest", ["--no-index", "--find-links", str(empty)])
    assert "pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==9.9.9" in failed.value.fix
    assert "--llama-cpp FILE" in failed.value.fix


@pytest.mark.skipif(not runtime_missing(), reason="llama-cpp-python is installed here")
def test_keeping_the_converter_ahead_without_the_runtime_exits_2(tmp_path):
    assert main(["--into", str(tmp_path / "kept")]) == 2
    assert not (tmp_path / "kept").exists()


def test_the_module_runs_as_a_script():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "lowmem_grpo.export.converter", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--sdist" in done.stdout and "--into" in done.stdout


def test_the_pinned_runtime_is_one_whose_source_digest_is_known_and_make_keeps_it_where_export_looks():
    import re
    import tomllib

    from packaging.requirements import Requirement

    repo = Path(__file__).resolve().parents[1]
    extra = [Requirement(r) for r in tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["gguf"]]
    pinned = {r.name: str(r.specifier).removeprefix("==") for r in extra}
    for constraints in ("constraints.txt", "constraints-vllm.txt"):
        text = (repo / constraints).read_text()
        assert re.search(rf"^llama-cpp-python=={re.escape(pinned['llama-cpp-python'])}$", text, re.M), constraints
        assert re.search(r"^diskcache==", text, re.M), constraints
    assert pinned["llama-cpp-python"] in KNOWN_SDISTS
    make = (repo / "Makefile").read_text()
    home = re.search(r"^GGUF_HOME := \$\(VENV\)/(\S+)$", make, re.M).group(1)
    assert prefix_root("PREFIX") == Path("PREFIX") / home
    assert "-m lowmem_grpo.export.converter --into $(GGUF_HOME)" in make
