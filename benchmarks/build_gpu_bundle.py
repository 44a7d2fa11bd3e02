"""Build the slimmed wheel bundle that benchmarks/gpu_check.py needs on the lent GPU machine.

    python benchmarks/build_gpu_bundle.py            # -> .whl/ (gitignored), prints sizes, fails at >= 64 MiB

That machine has torch, transformers, peft and accelerate but no trl, unsloth, unsloth_zoo, bitsandbytes or
datasets, and fetches nothing (shared/environment.md). Two wheels are slimmed, keeping their names: unsloth without
its top-level `studio/` web app (never imported), bitsandbytes with only `libbitsandbytes_cuda130.so`.
Install there as benchmarks/gpu_check.py says.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what a device call carries in all (working tree + carried paths)
# pinned as in constraints.txt; the image lacks these (datasets' dill/multiprocess, unsloth_zoo's
# torchao, cut-cross-entropy and msgspec, and tyro with its small deps)
PACKAGES = [
    "unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "trl==1.15.0", "bitsandbytes==0.50.2",
    "datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19", "torchao==0.18.0", "cut-cross-entropy==25.1.1",
    "msgspec==0.23.0", "tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.1", "shtab==1.8.0",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
KEEP_BNB_LIBRARY = "libbitsandbytes_cuda130.so"


def download(spec: str, dest: Path, python_version: str) -> Path:
    """One wheel for the GPU machine (x86-64 Linux, CPython `python_version`), no dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest), spec,
           *(arg for platform in PLATFORMS for arg in ("--platform", platform))]
    before = set(dest.glob("*.whl"))
    subprocess.run(cmd, check=True)
    name = spec.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    new = [p for p in found if p not in before] or found
    if len(new) != 1:
        raise SystemExit(f"expected one wheel for {spec}, found {[p.name for p in new]}")
    return new[0]


def slim(wheel: Path, drop) -> int:
    """Rewrite `wheel` in place without the members drop(name) picks (RECORD rewritten); the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            if info.filename == record_name or drop(info.filename):
                continue
            data = src.read(info.filename)
            out.writestr(info, data)
            if not info.filename.endswith("/"):
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                lines.append(f"{info.filename},sha256={digest},{len(data)}")
        lines.append(f"{record_name},,")
        out.writestr(record_name, "\n".join(lines) + "\n")
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def tree_size() -> int:
    """Bytes of what a device call sends besides .whl: tracked and untracked-not-ignored files."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                               capture_output=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / ".whl"), help="bundle folder (default: .whl/, gitignored)")
    parser.add_argument("--python-version", default="3.12", help="CPython of the GPU machine (default 3.12)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        for spec in PACKAGES:
            wheel = download(spec, staging, args.python_version)
            if wheel.name.startswith("unsloth-"):
                saved = slim(wheel, lambda n: n.startswith(("studio/", "unsloth/studio/")))
                print(f"  slimmed {wheel.name}: -{saved / 2**20:.1f} MiB (studio/)")
            elif wheel.name.startswith("bitsandbytes-"):
                saved = slim(wheel, lambda n: n.startswith("bitsandbytes/libbitsandbytes_")
                             and not n.endswith(KEEP_BNB_LIBRARY))
                print(f"  slimmed {wheel.name}: -{saved / 2**20:.1f} MiB (kept only {KEEP_BNB_LIBRARY})")
            shutil.move(str(wheel), out / wheel.name)
    wheels = sorted(out.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels)
    for p in wheels:
        print(f"{p.stat().st_size / 2**20:8.2f} MiB  {p.name}")
    tree = tree_size()
    print(f"bundle: {len(wheels)} wheels, {total / 2**20:.2f} MiB in {out}; working tree {tree / 2**20:.2f} MiB; "
          f"together {(total + tree) / 2**20:.2f} MiB of the {LIMIT / 2**20:.0f} MiB a device call carries")
    if total + tree >= LIMIT:
        print("error: the bundle and the working tree together are over the device call's limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
