"""llama.cpp's converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/) of the same llama.cpp as the
installed llama-cpp-python runtime, for `export --format gguf` from any install of the `gguf` extra.

llama-cpp-python ships as a source distribution that vendors llama.cpp and compiles it at install; the compiled
package keeps the runtime but not the converter, which only that source distribution carries. So the converter is
taken from the registry's source distribution of the installed version, once, into a cache folder: checked to be
that version's file (its sha256 where this module knows it, always its Python bindings byte for byte against the
installed package's), unpacked to the converter's files only, and recorded in SOURCE.json beside them. Later exports
find it there. `--llama-cpp` / $LLAMA_CPP_DIR name a llama.cpp folder, its converter script, or a source
distribution file instead (offline machines).

`python -m lowmem_grpo.export.converter [--sdist FILE] [--into DIR]` fetches it ahead of time (make install-gguf, an
image build)."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lowmem_grpo.errors import BadInputError, LowmemError

log = logging.getLogger(__name__)

DIST = "llama-cpp-python"
CONVERTER = "convert_hf_to_gguf.py"
LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
SOURCE_FILE = "SOURCE.json"
VENDOR = "vendor/llama.cpp/"
KEPT = ("convert_hf_to_gguf.py", "LICENSE", "conversion/", "gguf-py/")
"""What the converter needs of llama.cpp's tree (paths under vendor/llama.cpp/); 1.8 MB of the 76 MB file."""
BINDINGS = ("llama_cpp/__init__.py", "llama_cpp/llama_cpp.py")
"""The runtime's Python files compared with the source distribution's: the version and llama.cpp's C API it binds."""
KNOWN_SDISTS = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
"""sha256 of the registry's source distribution per version (pypi.org/simple/llama-cpp-python), for the pinned one."""
INSTALL = "pip install -c constraints.txt -e '.[gguf]' (make install-gguf), or pip install 'lowmem-grpo[gguf]'"


@dataclass(frozen=True)
class InstalledRuntime:
    """The installed llama-cpp-python: its version and the sha256 of its BINDINGS files."""

    version: str
    bindings: dict[str, str]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_runtime() -> InstalledRuntime | None:
    """This environment's llama-cpp-python, read without importing it (the import loads llama.cpp); None without."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    package = Path(list(spec.submodule_search_locations)[0])
    files = {name: package.parent / name for name in BINDINGS}
    return InstalledRuntime(version, {name: sha256_file(p) for name, p in files.items() if p.is_file()})


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where fetched converters are kept: $LOWMEM_GRPO_CACHE/llama.cpp (else ~/.cache/lowmem_grpo/llama.cpp), the
    folder the embedded model is converted into."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("LOWMEM_GRPO_CACHE", Path.home() / ".cache" / "lowmem_grpo")).expanduser() / "llama.cpp"


def prefix_root(prefix: str | Path | None = None) -> Path:
    """Where an install step keeps the converter beside the environment (make install-gguf, an image build)."""
    return Path(prefix or sys.prefix) / "share" / "lowmem_grpo" / "llama.cpp"


# --- the source distribution: checked, then unpacked to the converter's files ---------------------------------


def _member_path(name: str) -> PurePosixPath | None:
    """A member's path below the top folder, or None for the top folder itself; BadInputError for unsafe names."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise BadInputError(f"the source distribution holds an unsafe path {name!r}",
                            fix="use the registry's llama-cpp-python source distribution")
    return PurePosixPath(*path.parts[1:]) if len(path.parts) > 1 else None


def _kept(rel: PurePosixPath) -> str | None:
    """The path below vendor/llama.cpp/ of a member the converter needs, else None."""
    text = str(rel)
    if not text.startswith(VENDOR):
        return None
    inner = text[len(VENDOR):]
    return inner if any(inner == k or (k.endswith("/") and inner.startswith(k)) for k in KEPT) else None


def _llama_cpp_commit(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str | None:
    data = tar.extractfile(member)
    text = data.read(200).decode("ascii", "replace").strip() if data else ""
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


def unpack_converter(sdist: Path, runtime: InstalledRuntime, root: Path) -> Path:
    """Check that `sdist` is the source distribution of `runtime` and unpack its converter into root/VERSION
    (atomically: a partial folder is never left under that name); the converter script. BadInputError naming what
    differs otherwise."""
    sdist, version = Path(sdist), runtime.version
    digest, known = sha256_file(sdist), KNOWN_SDISTS.get(version)
    if known and digest != known:
        raise BadInputError(f"{sdist.name}: sha256 {digest} is not that of the registry's llama-cpp-python {version} "
                            f"source distribution ({known})", fix="download it again from the package index")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}.partial-", dir=root))
    # mkdtemp makes it 0700: a converter kept beside a shared environment (an image built as root) must be
    # readable by the users who run it, as a folder made by mkdir would be
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        found = _extract(sdist, runtime, staging)
        record = {"version": version, "sdist": sdist.name, "sdist_sha256": digest, "bindings": runtime.bindings,
                  "llama_cpp_commit": found["commit"], "files": found["files"]}
        (staging / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        target = root / version
        if target.exists():  # an older or broken copy: replaced whole
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("llama.cpp's converter of llama-cpp-python %s (llama.cpp %s) kept in %s", version,
             found["commit"] or "commit unknown", target)
    return target / CONVERTER


def _extract(sdist: Path, runtime: InstalledRuntime, into: Path) -> dict:
    """The KEPT files of `sdist` written under `into` after its name, version and bindings were checked."""
    version, bindings, files, commit = None, {}, 0, None
    try:
        tar = tarfile.open(sdist, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise BadInputError(f"{sdist} is not a source distribution archive ({exc})",
                            fix="give the llama_cpp_python-VERSION.tar.gz file pip downloads") from exc
    with tar:
        for member in tar:
            rel = _member_path(member.name)
            if rel is None:
                continue
            if str(rel) == "PKG-INFO" and member.isfile():
                version = _pkg_version(tar, member)
            elif str(rel) in BINDINGS and member.isfile():
                bindings[str(rel)] = hashlib.sha256(tar.extractfile(member).read()).hexdigest()
            elif str(rel) == ".git/modules/vendor/llama.cpp/HEAD" and member.isfile():
                commit = _llama_cpp_commit(tar, member)
            elif (inner := _kept(rel)) is not None and not member.isdir():
                if not member.isfile():
                    raise BadInputError(f"{sdist.name}: {member.name} is a link, not a file",
                                        fix="use the registry's llama-cpp-python source distribution")
                target = into / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                files += 1
    _check_source(sdist, runtime, version, bindings, into)
    return {"files": files, "commit": commit}


def _pkg_version(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str | None:
    text = tar.extractfile(member).read(4096).decode("utf-8", "replace")
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    name = fields.get("Name", "").lower().replace("_", "-")
    return fields.get("Version") if name == DIST else None


def _check_source(sdist: Path, runtime: InstalledRuntime, version: str | None, bindings: dict[str, str],
                  into: Path) -> None:
    """BadInputError unless the archive is llama-cpp-python `runtime.version` with the installed bindings and holds
    the converter."""
    if version != runtime.version:
        raise BadInputError(f"{sdist.name} is {'llama-cpp-python ' + version if version else 'not llama-cpp-python'}"
                            f", the installed runtime is {runtime.version}",
                            fix=f"give llama_cpp_python-{runtime.version}.tar.gz, the file the runtime was built from")
    differ = sorted(n for n in BINDINGS if n in runtime.bindings and bindings.get(n) != runtime.bindings[n])
    if differ:
        raise BadInputError(f"{sdist.name}: {', '.join(differ)} differ from the installed llama-cpp-python "
                            f"{version}'s: the runtime was built from other sources than this file",
                            fix="pass --llama-cpp with the llama.cpp folder the runtime was built from, or reinstall "
                                f"llama-cpp-python {version} from the package index")
    missing = [k.rstrip("/") for k in KEPT if not (into / k.rstrip("/")).exists()]
    if missing:
        raise BadInputError(f"{sdist.name} has no {', '.join(missing)} under {VENDOR}",
                            fix="pass --llama-cpp with a llama.cpp folder that holds the converter")


# --- finding it ------------------------------------------------------------------------------------------------


def kept_converter(root: Path, runtime: InstalledRuntime) -> Path | None:
    """The converter kept under root/VERSION for this very runtime (its SOURCE.json's version and bindings), else
    None."""
    folder = root / runtime.version
    try:
        record = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    same = record.get("version") == runtime.version and record.get("bindings") == runtime.bindings
    return folder / CONVERTER if same and (folder / CONVERTER).is_file() else None


def download_sdist(version: str, dest: Path, index_args: Sequence[str] = ()) -> Path:
    """The registry's llama-cpp-python `version` source distribution, downloaded into `dest` by pip (its index
    configuration, and the index's hash check); `index_args`: pip options choosing where from. BadInputError
    naming the offline fix when it cannot be fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", DIST, "-d", str(dest),
           *index_args, f"{DIST}=={version}"]
    log.info("fetching llama.cpp's converter: the llama-cpp-python %s source distribution (76 MB for 0.3.36)", version)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise BadInputError(
            f"--format gguf needs llama.cpp's {CONVERTER}, which only llama-cpp-python's source distribution carries, "
            f"and pip could not fetch llama-cpp-python {version}'s (exit {done.returncode}):\n{tail}",
            fix=f"where the package index is reachable run `pip download --no-deps --no-binary {DIST} "
                f"{DIST}=={version}` and pass the file with --llama-cpp FILE (or {LLAMA_CPP_ENV}), or pass "
                "--llama-cpp with a llama.cpp folder of the same version")
    return found[0]


def _explicit(given: str | Path, runtime: InstalledRuntime | None, cache: Path) -> Path:
    """--llama-cpp / $LLAMA_CPP_DIR: a folder, its converter script, or a source distribution file."""
    path = Path(given).expanduser()
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        if runtime is None:
            raise BadInputError("--llama-cpp names a source distribution, and llama-cpp-python is not installed",
                                fix=f"install the gguf extra: {INSTALL}")
        return kept_converter(cache, runtime) or unpack_converter(path, runtime, cache)
    script = path if path.is_file() else path / CONVERTER
    if not script.is_file():
        raise BadInputError(f"no {CONVERTER} at {script}",
                            fix=f"name a llama.cpp folder that holds it, or leave out --llama-cpp and {LLAMA_CPP_ENV} "
                                "to use the converter of the installed llama-cpp-python")
    return script


def provide(runtime: InstalledRuntime, root: Path, fetch: Callable[[str, Path], Path] = download_sdist) -> Path:
    """The converter kept in `root` for `runtime`, else fetched (`fetch(version, folder)` -> the source distribution
    file) and kept there."""
    if (script := kept_converter(root, runtime)) is not None:
        return script
    with tempfile.TemporaryDirectory(prefix="lowmem-sdist-") as tmp:
        sdist = fetch(runtime.version, Path(tmp))
        try:
            return unpack_converter(sdist, runtime, root)
        except OSError as exc:  # a folder that cannot be written
            raise LowmemError(f"could not keep llama.cpp's converter in {root}: {exc}",
                              fix="set LOWMEM_GRPO_CACHE to a writable folder") from exc


def find_converter(llama_cpp: str | Path | None = None, *, runtime: InstalledRuntime | None = None,
                   environ: Mapping[str, str] | None = None, prefix: str | Path | None = None,
                   fetch: Callable[[str, Path], Path] = download_sdist) -> Path:
    """The converter script: `llama_cpp` / $LLAMA_CPP_DIR (a folder, the script, or a source distribution), else the
    one kept for the installed runtime beside the environment (prefix_root) or in the cache (cache_root), else
    fetched into the cache (`provide`). `runtime`: default this environment's llama-cpp-python; `environ`: default
    os.environ; `prefix`: default sys.prefix."""
    environ = os.environ if environ is None else environ
    runtime = runtime or installed_runtime()
    cache = cache_root(environ)
    given = llama_cpp or environ.get(LLAMA_CPP_ENV)
    if given:
        return _explicit(given, runtime, cache)
    if runtime is None:
        raise BadInputError(f"--format gguf needs llama.cpp's {CONVERTER} of the installed llama-cpp-python, and "
                            "llama-cpp-python is not installed", fix=f"install the gguf extra: {INSTALL}")
    return kept_converter(prefix_root(prefix), runtime) or provide(runtime, cache, fetch)


def main(argv: list[str] | None = None) -> int:
    """Keep the installed runtime's converter in --into (default the cache), from --sdist or fetched."""
    parser = argparse.ArgumentParser(prog="python -m lowmem_grpo.export.converter", description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", help="the llama-cpp-python source distribution file (default: fetched)")
    parser.add_argument("--into", help="the folder to keep it in (default: $LOWMEM_GRPO_CACHE/llama.cpp)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.into) if args.into else cache_root()
    try:
        runtime = installed_runtime()
        if runtime is None:
            raise BadInputError("llama-cpp-python is not installed", fix=f"install the gguf extra: {INSTALL}")
        script = unpack_converter(Path(args.sdist), runtime, root) if args.sdist else provide(runtime, root)
    except LowmemError as exc:
        log.error("error: %s", exc)
        return exc.exit_code
    log.info("%s", script)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
