"""The package's shape: imports point down only, `import lowmem_grpo` stays light (docs/architecture.md describes it;
tests/test_docs.py checks that page names every part)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lowmem_grpo"
HEAVY = ("torch", "trl", "transformers", "unsloth", "peft", "datasets", "vllm")
# the modules allowed to import a heavy library at module level (each imported after backends.prepare())
HEAVY_AT_IMPORT = {"train/grpo.py", "train/trainer.py", "train/callbacks.py", "train/cpu_logprobs.py",
                   "sampling/generate.py", "sampling/kv_cache.py"}


def _shape() -> dict:
    done = subprocess.run([sys.executable, str(REPO / "tools" / "layout_report.py"), "--json"], capture_output=True,
                          text=True, timeout=60, check=False)
    return json.loads(done.stdout)


def test_no_import_circles_no_upward_imports_every_module_on_a_floor():
    shape = _shape()
    assert shape["circles"] == []
    assert shape["upward_imports"] == []
    assert shape["unplaced"] == []
    assert shape["top_level_modules"] <= 12


def test_import_and_help_load_no_heavy_library():
    code = ("import sys, contextlib, io\n"
            "import lowmem_grpo, lowmem_grpo.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert lowmem_grpo.cli.main(['--help']) == 0\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_trainer_modules_import_heavy_libraries_at_module_level():
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if _module_level_imports(p) & set(HEAVY) and str(p.relative_to(PACKAGE)) not in HEAVY_AT_IMPORT]
    assert offenders == []


def test_no_class_is_defined_inside_a_function():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(PACKAGE)}:{c.lineno}" for c in ast.walk(node) if isinstance(c, ast.ClassDef)]
    assert found == []


def test_no_test_hook_in_the_package():
    hits = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if re.search(r"test_faults|TEST ONLY|FaultInjector", p.read_text(encoding="utf-8"))]
    assert hits == []
