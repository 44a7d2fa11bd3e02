"""Recipe files in and out: Python recipe modules, recipe.yaml, and `key.sub=value` overrides, every value checked
against its field's type; the flat train keys of earlier recipe files are read as their sections' (FLAT_TRAIN_KEYS).
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

from lowmem_grpo.errors import RecipeError, RetiredSettingError
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
    "auto_fit": "memory.auto_fit",
    "oom_retries": "memory.oom_retries",
    **dict.fromkeys(("shared_prompt", "merged_sampling", "cpu_attention", "sampling_engine"), "cpu.fast"),
}
"""Flat train keys -> their key under train. The four CPU speed switches read as train.cpu.fast: false when a file
turns any of them off."""


_NO_GAIN = "no run in docs/results.md gained from it (one lost 15 points of held-out accuracy)"
RETIRED_KEYS: dict[str, tuple[Any, str, str]] = {
    "train.selection.dynamic_sampling": (False, f"dynamic sampling was retired: {_NO_GAIN}",
                                         "remove the key: GRPO draws every problem alike, and a step whose groups "
                                         "all agree takes no optimizer step (docs/signal.md)"),
    "train.selection.curriculum": (False, f"the curriculum was retired: {_NO_GAIN}",
                                   "remove the key; data.generated.grpo_levels chooses the levels GRPO trains on"),
    "train.selection.promote_at": (0.6, "the curriculum (and its promote_at) was retired",
                                   "remove the key; data.generated.grpo_levels chooses the levels GRPO trains on"),
    "train.dynamic_sampling": (False, f"dynamic sampling was retired: {_NO_GAIN}", "remove the key"),
    "train.curriculum": (False, f"the curriculum was retired: {_NO_GAIN}",
                         "remove the key; data.generated.grpo_levels chooses the levels GRPO trains on"),
    "train.curriculum_promote_at": (0.6, "the curriculum was retired", "remove the key"),
}
"""Keys of features lowmem_grpo no longer has -> (their old default, why, fix). A recipe.yaml written before holds
them at the default, which is read as absent; any other value is a RetiredSettingError."""


def retired(key: str, value: Any) -> bool:
    """True when `key` is retired and `value` its old default (nothing to honour); RetiredSettingError otherwise."""
    if key not in RETIRED_KEYS:
        return False
    default, why, fix = RETIRED_KEYS[key]
    if value != default:
        raise RetiredSettingError(f"{key}={value!r}: {why}", fix=fix)
    return True


def _drop_retired(train: dict[str, Any]) -> None:
    """Remove the train section's retired keys (and emptied sections) in place, refusing any not at its default."""
    for key in [k for k in train if f"train.{k}" in RETIRED_KEYS]:
        retired(f"train.{key}", train.pop(key))
    for name, section in list(train.items()):
        if isinstance(section, dict) and any(f"train.{name}.{k}" in RETIRED_KEYS for k in section):
            for key in list(section):
                if retired(f"train.{name}.{key}", section[key]):
                    del section[key]
            if not section:
                del train[name]


def flat_train_key(path: list[str], value: Any = None) -> list[str]:
    """The key path a flat train key stands for; any other path (and `train.preflight` with a mapping) as it is."""
    if len(path) == 2 and path[0] == "train" and path[1] in FLAT_TRAIN_KEYS and not isinstance(value, dict):
        new = ["train", *FLAT_TRAIN_KEYS[path[1]].split(".")]
        log.debug("recipe key %s is read as %s", ".".join(path), ".".join(new))
        return new
    return path


def train_keys() -> dict[str, str]:
    """Every train key (sections' dotted) and flat key -> the key to write: the did-you-mean of an unknown one."""
    keys, todo = {}, [(TrainConfig, "")]
    while todo:
        cls, prefix = todo.pop()
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                todo.append((hint, f"{prefix}{name}."))
            elif name != "extra":
                keys[prefix + name] = prefix + name
    return {**keys, **FLAT_TRAIN_KEYS}


def _sectioned(data: Any) -> Any:
    """`data` with the train section's flat keys moved to their sections; RecipeError for a key given both ways."""
    if not isinstance(data, dict) or not isinstance(data.get("train"), dict):
        return data
    data = copy.deepcopy(data)
    train = data["train"]
    _drop_retired(train)
    # popped first: `preflight: true` gives way to its section
    flat = {k: train.pop(k) for k in list(train) if k in FLAT_TRAIN_KEYS and not isinstance(train[k], dict)}
    moved = set()
    for key, value in flat.items():
        *sections, leaf = flat_train_key(["train", key], value)[1:]
        node = train
        for depth, part in enumerate(sections):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = "train." + ".".join(sections[:depth + 1])
                raise RecipeError(f"train.{key} belongs in section {where}, which is not a mapping",
                                  fix=f"write {where} as key: value lines")
        target = "train." + ".".join([*sections, leaf])
        if leaf in node and target not in moved:
            raise RecipeError(f"train.{key} and {target} are both set", fix=f"keep {target} only")
        if leaf in node and isinstance(node[leaf], bool) and isinstance(value, bool):
            value = node[leaf] and value  # the CPU speed switches: fast only when every one is on
        node[leaf] = value
        moved.add(target)
    return data


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(options))}"


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` as type `hint`, or RecipeError naming `key`."""
    origin, args = get_origin(hint), get_args(hint)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (Union, types.UnionType):  # every union of the recipe is `T | None`
        return None if value is None else _coerce(value, args[0], key)
    if origin is Literal:
        if isinstance(value, str) and any(isinstance(a, bool) for a in args):  # an override's raw "true"/"false"
            value = {"true": True, "false": False}.get(value.lower(), value)
        if not any(value == a and type(value) is type(a) for a in args):
            raise RecipeError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}",
                              fix=f"use one of {', '.join(map(str, args))}")
        return value
    if hint is Any or hint is bool and isinstance(value, bool) or hint is int and number and isinstance(value, int):
        return value
    if hint is float and (number or isinstance(value, str)):
        try:
            return float(value)  # YAML 1.1 reads "2e-5" (no dot) as a string
        except ValueError:
            pass
    if hint is str and (number or isinstance(value, str)):
        return str(value)
    if origin is list and isinstance(value, (str, list, tuple)):
        items = [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value
        return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(items)]
    if origin is dict and isinstance(value, dict):
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    type_name = getattr(hint, "__name__", str(hint))
    raise RecipeError(f"{key}: expected {type_name}, got {type(value).__name__} {value!r}",
                      fix=f"give {key} a value of type {type_name}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{prefix or 'recipe'}: expected a mapping, got {type(data).__name__}",
                          fix="write the section as key: value lines")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if cls is TrainConfig and (key not in hints or key == "extra"):
            extra[key] = value  # checked against GRPOConfig's fields by check_trainer_fields
        elif key not in hints:
            raise RecipeError(f"unknown key {full!r}", fix=_did_you_mean(key, list(hints)))
        elif dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _build(hints[key], value, f"{full}.")
        else:
            kwargs[key] = _coerce(value, hints[key], full)
    if extra:
        kwargs["extra"] = extra
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """A Recipe from plain data (a parsed recipe.yaml), rejecting unknown keys and wrong types."""
    return _build(Recipe, _sectioned(data), "")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data for recipe.yaml; train.extra is written flat into the train section."""
    data = dataclasses.asdict(recipe)
    data["train"].update(data["train"].pop("extra"))
    return data


def dump_yaml(recipe: Recipe) -> str:
    """The recipe as YAML that `recipe_from_dict(yaml.safe_load(...))` reads back identically."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)


def explicit_keys(overrides: list[str]) -> set[str]:
    """The dotted keys overrides set (malformed entries ignored): auto-fit and OOM retries never change them."""
    keys = set()
    for text in overrides or []:
        key, sep, _ = text.partition("=")
        if sep and key.strip():
            keys.add(".".join(flat_train_key(key.strip().split("."))))
    return keys


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """A new Recipe with `key.sub=value` overrides (YAML values) applied and type-checked."""
    data = recipe_to_dict(recipe)
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {text!r} is not key=value", fix="write overrides like train.max_steps=10")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"override {text!r}: value is not valid YAML ({exc})", fix="quote the value") from exc
        if retired(key.strip(), value):
            continue
        path = flat_train_key(key.strip().split("."), value)
        node = data
        for depth, part in enumerate(path[:-1]):
            if not isinstance(node.get(part), dict):
                known = [k for k, v in node.items() if isinstance(v, dict)]
                where = ".".join(path[: depth + 1])
                raise RecipeError(f"unknown section {where!r} in override {text!r}", fix=_did_you_mean(part, known))
            node = node[part]
        if isinstance(node.get(path[-1]), str) and not isinstance(value, str) and value is not None:
            value = raw  # string fields keep the raw text ("0.5", "true")
        node[path[-1]] = value
    return recipe_from_dict(data)


def _from_module(path: Path) -> Recipe:
    """The Recipe a module's `recipe()` returns; a flat train key given to TrainConfig is named with its section."""
    module_name = f"lowmem_grpo_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)  # a .py file: a spec with a loader
    module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise RecipeError(f"{path}:{exc.lineno}: syntax error in recipe module: {exc.msg}",
                          fix="fix the Python syntax at that line") from exc
    except Exception as exc:
        raise RecipeError(f"{path}: importing the recipe module failed: {type(exc).__name__}: {exc}",
                          fix="run `python` on the file to see the traceback") from exc
    build = getattr(module, "recipe", None)
    if not callable(build):
        raise RecipeError(f"{path}: defines no recipe() function",
                          fix="add `def recipe() -> Recipe:` returning the Recipe")
    try:
        recipe = build()
    except TypeError as exc:
        found = re.search(r"TrainConfig.__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
        if found and any(k.startswith(f"train.{found.group(1)}") for k in RETIRED_KEYS):
            key = next(k for k in RETIRED_KEYS if k.startswith(f"train.{found.group(1)}"))
            raise RetiredSettingError(f"{path}: TrainConfig({found.group(1)}=...): {RETIRED_KEYS[key][1]}",
                                      fix=RETIRED_KEYS[key][2]) from exc
        if not found or found.group(1) not in FLAT_TRAIN_KEYS:
            raise
        key, new = found.group(1), FLAT_TRAIN_KEYS[found.group(1)]
        *sections, leaf = new.split(".")
        cls, opened = TrainConfig, []
        for name in sections:  # eval=EvalConfig(stage=StageEvalConfig(problems=...))
            cls = typing.get_type_hints(cls)[name]
            opened.append(f"{name}={cls.__name__}(")
        argument = "".join(opened) + f"{leaf}=..." + ")" * len(opened)
        raise RecipeError(f"{path}: TrainConfig has no argument {key!r}: its setting is train.{new}",
                          fix=f"write TrainConfig({argument}) (lowmem_grpo.recipe)") from exc
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"{path}: recipe() returned {type(recipe).__name__}, not a Recipe",
                          fix="return lowmem_grpo.recipe.Recipe(...)")
    return recipe_from_dict(recipe_to_dict(recipe))  # re-checks the types a module could get wrong


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
        recipe = _from_module(path)
    else:
        raise RecipeError(f"{path}: unknown recipe file type {path.suffix!r}", fix="use a .py module or recipe.yaml")
    return apply_overrides(recipe, overrides or [])


def shipped_recipes() -> list[Path]:
    """The recipe modules shipped in recipes/."""
    return sorted(p for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))
