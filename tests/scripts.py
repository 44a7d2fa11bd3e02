"""Loading a script of benchmarks/ or tools/ (not a package) as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The module of the script at `path`, registered in sys.modules under `name` (its file's stem by default), as a
    script run has it: dataclasses look their module up there. Its folder goes on sys.path first, so the script's
    own `from sibling import ...` finds the scripts beside it."""
    name = name or path.stem
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
