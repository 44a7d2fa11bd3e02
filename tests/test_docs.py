"""Facts in README.md and docs/ that cannot drift: the recipes they name exist, one CPU default everywhere, every
command they show parses, the architecture page names every part of the package, every link resolves."""

from __future__ import annotations

import argparse
import logging
import re
import shlex
from pathlib import Path

import pytest

from lowmem_grpo import DEFAULT_RECIPE
from scripts import load_script

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
PACKAGE = REPO / "lowmem_grpo"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Each shell command of the page's code blocks, split into words: continuation lines joined, `$ ` prompts and
    comments dropped, `&&` chains split, leading VAR=value assignments dropped."""
    commands = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # output lines with stray quotes are not commands
                continue
            part: list[str] = []
            for word in [*words, "&&"]:
                if word != "&&":
                    part.append(word)
                    continue
                while part and re.fullmatch(r"[A-Z_]+=\S*", part[0]):
                    part = part[1:]
                if part:
                    commands.append(part)
                part = []
    return commands


def _cli_args(words: list[str]) -> list[str] | None:
    """The arguments after `lowmem-grpo` (any path to it, or the image of `docker run`) or `-m lowmem_grpo.cli`;
    None for other commands."""
    if Path(words[0]).name == "lowmem-grpo":
        return words[1:]
    if words[:2] == ["docker", "run"] and "lowmem-grpo" in words:
        return words[words.index("lowmem-grpo") + 1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "lowmem_grpo.cli":
            return words[i + 2:]
    return None


def test_every_recipe_file_the_docs_name_exists():
    named = {m for page in PAGES for m in re.findall(r"recipes/[a-z0-9_./-]+\.(?:py|yaml|json)", _text(page))}
    assert named, "the docs name no recipe"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert missing == [], f"README/docs name recipes that do not exist: {missing}"


def test_the_readme_recipe_table_lists_every_shipped_recipe_with_the_default_first():
    rows = [line for line in _text(README).splitlines() if line.startswith("| `recipes/")]
    listed = [re.search(r"`(recipes/[^`]+)`", row).group(1) for row in rows]
    shipped = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*.py"))
    assert sorted(listed) == shipped
    assert listed[0] == DEFAULT_RECIPE and "default" in rows[0] and "make demo" in rows[0]


def test_one_cpu_default_makefile_readme_cli_hint_and_benchmark(caplog):
    makefile = _text(REPO / "Makefile")
    demo = re.search(r"^demo:.*\n\t(.+)$", makefile, flags=re.M).group(1).split()
    assert demo[-2:] == ["train", DEFAULT_RECIPE] and demo[0].endswith("lowmem-grpo"), demo
    assert f"`make demo` runs `lowmem-grpo train {DEFAULT_RECIPE}`" in _text(README)

    from lowmem_grpo.cli import main

    with caplog.at_level(logging.ERROR, logger="lowmem_grpo"):
        assert main(["train"]) == 2  # no recipe: the usage error's fix names the default
    assert f"lowmem-grpo train {DEFAULT_RECIPE}" in caplog.text
    # no other recipe calls itself the default
    for path in (REPO / "recipes").glob("*.py"):
        if path != REPO / DEFAULT_RECIPE:
            head = _text(path).split('"""')[1]
            assert "the CPU default (" not in head and "(or: make demo)" not in head, path


def test_every_readme_and_docs_command_parses():
    from lowmem_grpo.cli import build_parser

    parser = build_parser()
    make_targets = set(re.findall(r"^([a-z-]+):", _text(REPO / "Makefile"), flags=re.M))
    checked = {"cli": 0, "make": 0, "script": 0}
    for page in PAGES:
        for words in _commands(_text(page)):
            args = _cli_args(words)
            if args is not None:
                try:
                    parser.parse_args(args)
                except (SystemExit, argparse.ArgumentError) as exc:  # an unknown command or option
                    pytest.fail(f"{page.name}: `lowmem-grpo {' '.join(args)}` does not parse ({exc})")
                checked["cli"] += 1
            elif words[0] == "make":
                assert words[1] in make_targets, f"{page.name}: no make target {words[1]!r}"
                checked["make"] += 1
            elif Path(words[0]).name.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
                assert (REPO / words[1]).exists(), f"{page.name}: no script {words[1]}"
                checked["script"] += 1
    assert checked["cli"] >= 10 and checked["make"] >= 2 and checked["script"] >= 5, checked


def test_readme_subcommands_exist_and_answer_help(capsys):
    from lowmem_grpo.cli import build_parser, main

    commands = {args[0] for words in _commands(_text(README)) if (args := _cli_args(words))}
    known = set(build_parser()._subparsers._group_actions[0].choices)
    assert commands and commands <= known, commands - known
    for command in sorted(commands):
        assert main([command, "--help"]) == 0
        assert f"usage: lowmem-grpo {command}" in capsys.readouterr().out


def _package_parts() -> list[str]:
    """Every folder of the package (a subpackage or resources/) and every top-level module."""
    folders = [p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]
    modules = [p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    return sorted(folders) + sorted(modules)


def test_the_architecture_page_names_every_package_folder_and_module():
    text = _text(REPO / "docs" / "architecture.md")
    missing = [p for p in _package_parts() if f"`{p}/`" not in text and f"`{p}`" not in text and f"`{p}.py`" not in text]
    assert missing == [], f"docs/architecture.md does not name: {missing}"
    named = set(re.findall(r"`([a-z_]+)/`", text))
    outside = {"recipes", "benchmarks", "tests", "tools", "docs", "accelerate"}
    gone = sorted(n for n in named - outside if not (PACKAGE / n).is_dir())
    assert gone == [], f"docs/architecture.md names folders that do not exist: {gone}"


def test_the_architecture_floors_are_the_layout_tools_floors():
    layout_report = load_script(REPO / "tools" / "layout_report.py")
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", _text(REPO / "docs" / "architecture.md"), flags=re.M)
    floors = {name: int(floor) for floor, names in rows for name in re.findall(r"`([a-z_]+)/?`", names)}
    assert floors == layout_report.FLOORS


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _text(page)):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert broken == []


def test_the_front_page_stays_short_and_speaks_of_the_product():
    text = _text(README)
    assert len(text.splitlines()) <= 160
    for page in PAGES:
        body = _text(page)
        assert not re.search(r"\bissue \d+|\bload average|\bload \d", body, flags=re.I), page.name


def test_what_the_readme_says_make_demo_runs_is_the_default_recipe():
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(str(REPO / DEFAULT_RECIPE))
    text = " ".join(_text(README).split())
    said = {"held-out problems": int(re.search(r"accuracy on (\d+) held-out problems", text).group(1)),
            "priming steps": int(re.search(r"format priming \((\d+) supervised steps\)", text).group(1)),
            "GRPO steps": int(re.search(r"(\d+) GRPO steps \(one console line", text).group(1))}
    assert said == {"held-out problems": recipe.train.eval.stage.problems, "priming steps": recipe.prime.max_steps,
                    "GRPO steps": recipe.train.max_steps}
