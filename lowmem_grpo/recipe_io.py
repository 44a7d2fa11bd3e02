"""Recipe files in and out: Python recipe modules, recipe.yaml, and `key.sub=value` overrides (and which
keys they set explicitly).

Every value is checked against the dataclass field's type here, so a typo or a wrong type fails
with the key's name and a did-you-mean before anything heavy is imported. The flat train keys of earlier
recipe files and commands (`train.stage_eval=200`) are read as their sections' keys (FLAT_TRAIN_KEYS).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe, TrainConfig

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"

log = logging.getLogger(__name__)

FLAT_TRAIN_KEYS = {
    "eval_every": "eval.every",
    "eval_limit": "eval.problems",
    "eval_samples": "eval.samples",
    "eval_batch_size": "eval.batch_size",
    "stage_eval": "eval.stage.problems",
    "stage_eval_stages": "eval.stage.stages",
    "stage_eval_samples": "eval.stage.samples",
    "preflight": "preflight.enabled",
    "preflight_prompts": "preflight.prompts",
    "allow_no_signal": "preflight.allow_no_signal",
    "dynamic_sampling": "selection.dynamic_sampling",
    "curriculum": "selection.curriculum",
    "curriculum_promote_at": "selection.promote_at",
    "auto_fit": "memory.auto_fit",
    "oom_retries": "memory.oom_retries",
    "shared_prompt": "cpu.fast",
    "merged_sampling": "cpu.fast",
    "cpu_attention": "cpu.fast",
    "sampling_engine": "cpu.fast",
}
"""Flat keys of the train section (recipe files and overrides written for them) -> their key under train. The four
CPU speed switches are one, train.cpu.fast: a file that turns any of them off reads as false (every path off, as
TRL, PEFT and transformers run), one that leaves all on as true; an override gives train.cpu.fast its value."""


def flat_train_key(path: list[str], value: Any = None) -> list[str]:
    """The key path a flat train key (FLAT_TRAIN_KEYS) stands for; any other path as it is. `train.preflight` with a
    mapping is the section itself."""
    if len(path) == 2 and path[0] == "train" and path[1] in FLAT_TRAIN_KEYS and not isinstance(value, dict):
        new = ["train", *FLAT_TRAIN_KEYS[path[1]].split(".")]
        log.debug("recipe key %s is read as %s", ".".join(path), ".".join(new))
        return new
    return path


def train_keys() -> dict[str, str]:
    """Every key of the train section, its sections' keys dotted ("eval.stage.problems"), and the flat keys
    (FLAT_TRAIN_KEYS) -> the key to write: the did-you-mean of an unknown train key."""
    keys: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")
            elif name != "extra":
                keys[prefix + name] = prefix + name

    walk(TrainConfig, "")
    return {**keys, **FLAT_TRAIN_KEYS}


def _sectioned(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a parsed recipe) with the train section's flat keys (FLAT_TRAIN_KEYS) moved to their sections; the
    four CPU speed switches agree on train.cpu.fast only when all are true. RecipeError for a key given both ways."""
    train = data.get("train") if isinstance(data, dict) else None
    flat = [k for k, v in train.items() if k in FLAT_TRAIN_KEYS and not isinstance(v, dict)] if isinstance(
        train, dict) else []
    if not flat:
        return data
    data = copy.deepcopy(data)
    train = data["train"]
    values = {key: train.pop(key) for key in flat}  # first: `preflight: true` gives way to its section
    moved: dict[str, str] = {}
    for key, value in values.items():
        *sections, leaf = flat_train_key(["train", key], value)[1:]
        node = train
        for depth, part in enumerate(sections):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = "train." + ".".join(sections[:depth + 1])
                raise RecipeError(f"train.{key} belongs in section {where}, which is not a mapping",
                                  fix=f"write {where} as key: value lines")
        target = "train." + ".".join([*sections, leaf])
        if leaf in node and target not in moved.values():
            raise RecipeError(f"train.{key} and {target} are both set", fix=f"keep {target} only")
        if leaf in node and isinstance(node[leaf], bool) and isinstance(value, bool):
            value = node[leaf] and value  # the CPU speed switches: fast only when every one is on
        node[leaf] = value
        moved[key] = target
    return data


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(options))}"


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Return `value` as type `hint`, or raise RecipeError naming `key`."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except RecipeError as exc:
                errors.append(str(exc))
        raise RecipeError(errors[0] if errors else f"{key}: cannot be None", fix="see `lowmem-grpo validate`")
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}",
                              fix=f"use one of {', '.join(map(str, args))}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "2e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    type_name = getattr(hint, "__name__", str(hint))
    raise RecipeError(f"{key}: expected {type_name}, got {type(value).__name__} {value!r}",
                      fix=f"give {key} a value of type {type_name}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{prefix or 'recipe'}: expected a mapping, got {type(data).__name__}",
                          fix="write the section as key: value lines")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints or (cls is TrainConfig and key == "extra"):
            if cls is TrainConfig:
                extra[key] = value  # checked against GRPOConfig's fields by trainer_fields
                continue
            raise RecipeError(f"unknown key {full!r}", fix=_did_you_mean(key, names))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{full}.")
        else:
            kwargs[key] = _coerce(value, hint, full)
    if extra:
        kwargs["extra"] = extra
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Build a Recipe from plain data (a parsed recipe.yaml; flat train keys read as FLAT_TRAIN_KEYS says),
    rejecting unknown keys and wrong types."""
    return _build(Recipe, _sectioned(data), "")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data for recipe.yaml; train.extra is written flat into the train section."""
    data = dataclasses.asdict(recipe)
    data["train"].update(data["train"].pop("extra"))
    return data


def dump_yaml(recipe: Recipe) -> str:
    """The recipe as YAML that `recipe_from_dict(yaml.safe_load(...))` reads back identically."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `key.sub=value` into its key path and YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override {text!r} is not key=value", fix="write overrides like train.max_steps=10")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({exc})", fix="quote the value") from exc
    return key.strip().split("."), value


def explicit_keys(overrides: list[str]) -> set[str]:
    """The dotted keys set by `key.sub=value` overrides (values and malformed entries ignored): auto-fit and OOM
    retries never change them."""
    keys = set()
    for text in overrides or []:
        key, sep, _ = text.partition("=")
        if sep and key.strip():
            keys.add(".".join(flat_train_key(key.strip().split("."))))
    return keys


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Return a new Recipe with `key.sub=value` overrides applied and type-checked."""
    data = recipe_to_dict(recipe)
    for text in overrides:
        path, value = parse_override(text)
        path = flat_train_key(path, value)
        node = data
        for depth, part in enumerate(path[:-1]):
            if not isinstance(node.get(part), dict):
                known = [k for k, v in node.items() if isinstance(v, dict)]
                where = ".".join(path[: depth + 1])
                raise RecipeError(f"unknown section {where!r} in override {text!r}", fix=_did_you_mean(part, known))
            node = node[part]
        leaf = path[-1]
        if isinstance(node.get(leaf), str) and not isinstance(value, str) and value is not None:
            value = text.partition("=")[2]  # keep the raw text for string fields ("0.5", "true")
        node[leaf] = value
    return recipe_from_dict(data)


def _load_module(path: Path) -> types.ModuleType:
    module_name = f"lowmem_grpo_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"{path}: cannot be imported as a Python module", fix="give a .py or .yaml recipe")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise RecipeError(f"{path}:{exc.lineno}: syntax error in recipe module: {exc.msg}",
                          fix="fix the Python syntax at that line") from exc
    except Exception as exc:
        raise RecipeError(f"{path}: importing the recipe module failed: {type(exc).__name__}: {exc}",
                          fix="run `python` on the file to see the traceback") from exc
    return module


def _flat_keyword(path: Path, exc: TypeError) -> RecipeError | None:
    """RecipeError naming the section for `TrainConfig(stage_eval=...)`, a flat train key given as an argument;
    None for any other TypeError."""
    found = re.search(r"TrainConfig.__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
    if not found or found.group(1) not in FLAT_TRAIN_KEYS:
        return None

    def argument(cls: type, parts: list[str]) -> str:
        if len(parts) == 1:
            return f"{parts[0]}=..."
        hint = typing.get_type_hints(cls)[parts[0]]
        return f"{parts[0]}={hint.__name__}({argument(hint, parts[1:])})"

    key, new = found.group(1), FLAT_TRAIN_KEYS[found.group(1)]
    return RecipeError(f"{path}: TrainConfig has no argument {key!r}: its setting is train.{new}",
                       fix=f"write TrainConfig({argument(TrainConfig, new.split('.'))}) (lowmem_grpo.recipe)")


def locate_recipe(spec: str) -> Path:
    """A recipe path, or a shipped recipe's bare name (`smollm2_135m_gsm8k_cpu`)."""
    path = Path(spec)
    if path.exists():
        return path
    shipped = RECIPES_DIR / f"{spec}.py"
    if "/" not in spec and shipped.exists():
        return shipped
    names = [p.stem for p in RECIPES_DIR.glob("*.py")] if RECIPES_DIR.is_dir() else []
    hint = _did_you_mean(spec, names) if names else "give the path to a recipe .py or recipe.yaml"
    raise RecipeError(f"recipe file {spec!r} does not exist", fix=hint)


def load_recipe(spec: str, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe module (its `recipe()` function) or a recipe.yaml, then apply overrides."""
    path = locate_recipe(spec)
    if path.is_dir() and (path / "recipe.yaml").exists():
        path = path / "recipe.yaml"
    if path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: invalid YAML: {exc}", fix="fix the YAML syntax") from exc
        recipe = recipe_from_dict(data)
    elif path.suffix == ".py":
        module = _load_module(path)
        build = getattr(module, "recipe", None)
        if not callable(build):
            raise RecipeError(f"{path}: defines no recipe() function",
                              fix="add `def recipe() -> Recipe:` returning the Recipe")
        try:
            recipe = build()
        except TypeError as exc:
            flat = _flat_keyword(path, exc)
            if flat is None:
                raise
            raise flat from exc
        if not isinstance(recipe, Recipe):
            raise RecipeError(f"{path}: recipe() returned {type(recipe).__name__}, not a Recipe",
                              fix="return lowmem_grpo.recipe.Recipe(...)")
        recipe = recipe_from_dict(recipe_to_dict(recipe))  # re-checks the types a module could get wrong
    else:
        raise RecipeError(f"{path}: unknown recipe file type {path.suffix!r}", fix="use a .py module or recipe.yaml")
    return apply_overrides(recipe, overrides or [])


def shipped_recipes() -> list[Path]:
    """The recipe modules shipped in recipes/."""
    return sorted(p for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))
