"""GGUF files from a merged export, made and run by llama.cpp (the `gguf` extra, `make install-gguf`; docs/runs.md).

The extra installs llama-cpp-python and keeps the converter of that same llama.cpp in
PREFIX/share/lowmem_grpo/llama.cpp (converter_home); the converter runs with its own gguf-py first on its path, so
the environment's pinned `gguf` package is left alone. f16 and bf16 come from the converter, q8_0 and q4_k_m from
llama.cpp's llama_model_quantize over the 16-bit file. Every llama.cpp step runs in a child process
(lowmem_grpo.export.llama_runner): a crash there is an error with the child's stderr tail, never the caller's death.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError, LowmemError

log = logging.getLogger(__name__)

GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_k_m")
QUANTIZED = ("q8_0", "q4_k_m")
GGUF_FILE_TYPES = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
CONVERTER = "convert_hf_to_gguf.py"
LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
INSTALL = "make install-gguf"
INSTALL_WHY = ("the `gguf` extra (llama-cpp-python 0.3.36, built from source at install, about 4 minutes on 2 cores, "
               "and the converter of the same llama.cpp)")
CHILD_TIMEOUT_S = 3600
STDERR_TAIL_LINES = 15


def converter_home() -> Path:
    """Where `make install-gguf` keeps llama.cpp's converter: PREFIX/share/lowmem_grpo/llama.cpp."""
    return Path(sys.prefix) / "share" / "lowmem_grpo" / "llama.cpp"


def find_converter(llama_cpp: str | Path | None = None) -> Path:
    """The converter script: --llama-cpp / $LLAMA_CPP_DIR (a folder or the script), else the extra's own."""
    given = llama_cpp or os.environ.get(LLAMA_CPP_ENV)
    if given:
        path = Path(given).expanduser()
        script = path if path.is_file() else path / CONVERTER
        if not script.is_file():
            raise BadInputError(f"no {CONVERTER} at {script}",
                                fix=f"name a llama.cpp folder that holds it, or leave out --llama-cpp and "
                                    f"{LLAMA_CPP_ENV} to use the one `{INSTALL}` keeps")
        return script
    script = converter_home() / CONVERTER
    if not script.is_file():
        raise BadInputError(f"--format gguf needs llama.cpp's {CONVERTER}, and {script.parent} has none",
                            fix=f"run `{INSTALL}` ({INSTALL_WHY}), or pass --llama-cpp DIR")
    return script


def check_runtime() -> None:
    """BadInputError naming the install command when llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BadInputError("--format gguf runs the file in llama.cpp to prove it, and llama-cpp-python is not "
                            "installed", fix=f"run `{INSTALL}` ({INSTALL_WHY})")


def check_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise BadInputError(f"--gguf-type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}",
                            fix="use f16 or bf16 (exact), or q8_0 / q4_k_m (quantized, proven by accuracy)")


def _tail(text: str) -> str:
    return "\n".join((text or "").strip().splitlines()[-STDERR_TAIL_LINES:])


def run_child(job: dict[str, Any], what: str) -> dict[str, Any]:
    """Run one llama_runner job in a child process; LowmemError with its stderr tail when it fails or crashes."""
    with tempfile.TemporaryDirectory(prefix="lowmem-llama-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({**job, "result": str(result)}), encoding="utf-8")
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding lowmem_grpo, for the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "lowmem_grpo.export.llama_runner", str(request)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise LowmemError(f"{what}: llama.cpp did not finish in {CHILD_TIMEOUT_S} s",
                              fix="see the log; nothing was written") from exc
        if done.returncode != 0 or not result.is_file():
            how = f"exit {done.returncode}" if done.returncode >= 0 else f"killed by signal {-done.returncode}"
            raise LowmemError(f"{what}: llama.cpp failed ({how}):\n{_tail(done.stderr or done.stdout)}",
                              fix="see the error above; nothing was written")
        return json.loads(result.read_text(encoding="utf-8"))


def convert(script: Path, merged: Path, target: Path, outtype: str) -> None:
    """convert_hf_to_gguf.py `merged` -> `target` at `outtype` (f16, bf16 or f32), in a child process."""
    cmd = [sys.executable, str(script), str(merged), "--outfile", str(target), "--outtype", outtype]
    log.info("converting to GGUF: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0 or not target.is_file():
        raise LowmemError(f"{script.name} failed (exit {done.returncode}):\n{_tail(done.stderr or done.stdout)}",
                          fix=f"reinstall the converter with `{INSTALL}`, or use a llama.cpp version that "
                              "supports this architecture")


def quantize(src: Path, dst: Path, gguf_type: str) -> float:
    """llama.cpp's llama_model_quantize `src` -> `dst`; returns its seconds."""
    answer = run_child({"job": "quantize", "src": str(src), "dst": str(dst), "type": gguf_type},
                       f"quantize to {GGUF_FILE_TYPES[gguf_type]}")
    return float(answer["seconds"])


def tokenizer_kind(path: Path) -> tuple[str | None, str | None]:
    """The GGUF's tokenizer.ggml.model and tokenizer.ggml.pre (what llama.cpp tokenizes with)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
        raise LowmemError(f"{path.name} is not a GGUF file llama.cpp can read: {exc}",
                          fix="reinstall the converter with `make install-gguf`; nothing was written") from exc

    def text(key: str) -> str | None:
        field = reader.get_field(key)
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")

    return text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")


def file_name(recipe_name: str, gguf_type: str) -> str:
    return f"{recipe_name}-{GGUF_FILE_TYPES[gguf_type]}.gguf"
