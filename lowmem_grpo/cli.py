"""The `lowmem-grpo` command: argument parsing and exit codes only; each command calls one function.

Exit codes: 0 success, 1 failure while running, 2 bad input (usage, recipe, data), 3 no reward signal.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from lowmem_grpo.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, BadInputError, LowmemError

log = logging.getLogger("lowmem_grpo")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def cmd_train(args: argparse.Namespace) -> int:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train import train

    run_dir = train(load_recipe(args.recipe, args.overrides))
    log.info("done: adapter in %s", Path(run_dir) / "adapter")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from lowmem_grpo.recipe import validate
    from lowmem_grpo.recipe_io import dump_yaml, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    validate(recipe)
    from lowmem_grpo.data import source_exists

    if not source_exists(recipe.data.source):
        raise BadInputError(f"data.source {recipe.data.source!r}: no such file or folder",
                            fix="give an existing path, or use hub or embedded")
    if args.trainer_fields:
        from lowmem_grpo.train import check_trainer_fields

        check_trainer_fields(recipe)
    sys.stdout.write(dump_yaml(recipe) if args.show else f"ok: {args.recipe} ({recipe.name})\n")
    return EXIT_OK


def cmd_recipes(args: argparse.Namespace) -> int:
    from lowmem_grpo.recipe_io import load_recipe, shipped_recipes

    rows = [("recipe", "model", "task", "GPU memory", "description")]
    for path in shipped_recipes():
        recipe = load_recipe(str(path))
        gpu = f"{recipe.gpu_memory_gb} GB" if recipe.gpu_memory_gb else "CPU"
        rows.append((path.stem, recipe.model.name, recipe.task, gpu, recipe.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        sys.stdout.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] + "\n")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from lowmem_grpo.doctor import report

    text, problems = report()
    sys.stdout.write(text)
    return EXIT_FAILURE if problems else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(prog="lowmem-grpo", description="GRPO on one small GPU, in the least memory.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    overrides_help = "key.sub=value overrides, e.g. train.max_steps=10 model.backend=hf"

    p = sub.add_parser("train", help="train a recipe (.py module or recipe.yaml)")
    p.add_argument("recipe", help="recipes/NAME.py, a shipped recipe name, or RUN_DIR/recipe.yaml")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("validate", help="check a recipe without loading a model")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--show", action="store_true", help="print the resolved recipe as YAML")
    p.add_argument("--no-trainer-fields", dest="trainer_fields", action="store_false",
                   help="skip checking extra train keys against TRL's GRPOConfig (which imports trl)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("recipes", help="list the shipped recipes")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("doctor", help="print the environment and known-bad combinations")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except BadInputError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    except LowmemError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130


def main_for_recipe(recipe_file: str) -> int:
    """`python recipes/NAME.py [overrides]`: train that recipe."""
    return main(["train", recipe_file, *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
