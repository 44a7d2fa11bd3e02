"""pyproject.toml against the resolved sets it is installed with: the Pythons it admits are the ones every pinned
distribution admits."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)$")


def pins(name: str) -> dict[str, str]:
    found = {}
    for line in (REPO / name).read_text(encoding="utf-8").splitlines():
        match = PIN.match(line.split("#", 1)[0].strip())
        if match:
            found[canonicalize_name(match.group(1))] = match.group(2)
    return found


def admitted_minors(spec: SpecifierSet) -> list[str]:
    """The Python 3 minor versions `spec` admits at their first release (3.0 - 3.29)."""
    return [f"3.{m}" for m in range(30) if f"3.{m}.0" in spec]


def pinned_requires_python(constraints: str) -> dict[str, SpecifierSet]:
    """Requires-Python of each distribution the constraints file pins, read from the installed one at that version."""
    found = {}
    for name, version in pins(constraints).items():
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if canonicalize_name(meta["Name"]) == name and meta["Version"] == version and meta.get("Requires-Python"):
            found[name] = SpecifierSet(meta["Requires-Python"])
    return found


def test_requires_python_admits_only_pythons_every_pinned_distribution_admits():
    ours = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
                        ["project"]["requires-python"])
    theirs = pinned_requires_python("constraints.txt")
    assert {"trl", "torch", "transformers", "unsloth"} <= set(theirs)  # the set the tests run on is installed here
    refused = {minor: sorted(n for n, spec in theirs.items() if f"{minor}.0" not in spec)
               for minor in admitted_minors(ours)}
    assert not {m: names for m, names in refused.items() if names}, f"requires-python {ours} admits Pythons that " \
                                                                     f"pinned distributions refuse: {refused}"
    every = [m for m in admitted_minors(SpecifierSet(">=3")) if all(f"{m}.0" in spec for spec in theirs.values())]
    assert admitted_minors(ours)[0] == every[0]  # and it starts where the set does
