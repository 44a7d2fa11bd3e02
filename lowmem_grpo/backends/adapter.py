"""The LoRA adapter a run starts from (`lora.init_adapter`): checked against the recipe before any model loads.

A PEFT adapter folder holds adapter_config.json and its weights. It can only be the run's starting LoRA when
it was trained on the recipe's base model with the recipe's rank, alpha and target modules: anything else
would either fail deep inside PEFT after minutes of loading, or silently train a different adapter than the
one recipe.yaml describes. Each mismatch is named with the recipe key that fixes it (exit 2).

Base model names are compared loosely where the same weights go by several names: a local folder and its
resolved path, the embedded model's cache folder on another machine, and Unsloth's re-uploads (an adapter
trained with Unsloth records e.g. `unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit` for `Qwen/Qwen2.5-1.5B-Instruct`),
read from the installed Unsloth's own name table without importing Unsloth.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from lowmem_grpo.backends.embedded import PREFIX, is_embedded
from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# suffixes of Unsloth's pre-quantized uploads of a model (longest first)
UNSLOTH_SUFFIXES = ("-unsloth-bnb-4bit", "-bnb-4bit")
# PEFT options a plain LoRA of the recipe cannot express: (config key, value meaning "off", what it is)
UNSUPPORTED = (("use_dora", False, "DoRA"), ("use_rslora", False, "rank-stabilized LoRA"),
               ("rank_pattern", {}, "per-module ranks"), ("alpha_pattern", {}, "per-module alphas"),
               ("modules_to_save", None, "fully trained extra modules"), ("bias", "none", "trained biases"))


def check_init_adapter(lora: Any, model_name: str, model_path: str) -> Path:
    """The adapter folder of `lora.init_adapter` when it fits the recipe, else BadInputError naming every
    mismatch and its fix. Reads two small files; loads no model."""
    folder = adapter_folder(lora.init_adapter)
    config = read_adapter_config(folder)
    problems = [p for p in (_peft_type_problem(config), _base_problem(config, model_name, model_path),
                            _rank_problem(config, lora), _alpha_problem(config, lora),
                            _targets_problem(config, lora), *_unsupported_problems(config)) if p]
    if problems:
        raise BadInputError(f"lora.init_adapter {folder} does not fit the recipe: "
                            + "; ".join(problem for problem, _ in problems),
                            fix="; ".join(fix for _, fix in problems))
    log.info("starting from the LoRA adapter in %s (base %s, r=%s, modules %s)", folder,
             config.get("base_model_name_or_path"), config.get("r"), sorted(_as_set(config.get("target_modules"))))
    return folder


def adapter_folder(spec: str) -> Path:
    """The folder, when it exists and holds adapter_config.json and adapter weights (BadInputError otherwise)."""
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise BadInputError(f"lora.init_adapter {spec!r}: no such folder",
                            fix="point lora.init_adapter at a PEFT adapter folder (e.g. a run's adapter/)")
    if not (folder / ADAPTER_CONFIG).is_file():
        inside = [f"{folder / sub}" for sub in ("adapter", "primed_adapter") if (folder / sub / ADAPTER_CONFIG).is_file()]
        raise BadInputError(f"lora.init_adapter {spec!r}: no {ADAPTER_CONFIG} in it",
                            fix=f"point it at {' or '.join(inside)}" if inside
                            else "point it at a folder saved by PEFT's save_pretrained")
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise BadInputError(f"lora.init_adapter {spec!r}: holds {ADAPTER_CONFIG} but no adapter weights "
                            f"({' or '.join(ADAPTER_WEIGHTS)})", fix="copy the adapter folder whole")
    return folder


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json as a dict (BadInputError when it is not JSON)."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"lora.init_adapter {folder}: {ADAPTER_CONFIG} is unreadable ({exc})",
                            fix="copy the adapter folder whole") from exc
    if not isinstance(config, dict):
        raise BadInputError(f"lora.init_adapter {folder}: {ADAPTER_CONFIG} is not a JSON object",
                            fix="point it at a folder saved by PEFT's save_pretrained")
    return config


# --- one check each: None, or (the mismatch, its fix) ------------------------------------------------------------

def _peft_type_problem(config: dict[str, Any]) -> tuple[str, str] | None:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind == "LORA":
        return None
    return f"it is a {kind} adapter, not LoRA", "give a LoRA adapter"


def _base_problem(config: dict[str, Any], model_name: str, model_path: str) -> tuple[str, str] | None:
    recorded = config.get("base_model_name_or_path")
    if not recorded:  # some tools leave it empty: nothing to compare, so say so and trust the user
        log.warning("lora.init_adapter names no base model; assuming it was trained on %s", model_name)
        return None
    if same_base(str(recorded), model_name, model_path):
        return None
    return (f"its base model is {recorded}, the recipe's is {model_name}",
            f"set model.name={recorded} to match the adapter, or give an adapter trained on {model_name}")


def _rank_problem(config: dict[str, Any], lora: Any) -> tuple[str, str] | None:
    rank = config.get("r")
    if rank == lora.r:
        return None
    return (f"its rank is {rank}, lora.r is {lora.r}",
            f"set lora.r={rank} to match the adapter, or give an adapter of rank {lora.r}")


def _alpha_problem(config: dict[str, Any], lora: Any) -> tuple[str, str] | None:
    # alpha / r scales the adapter's output: another alpha would start GRPO from a different model
    alpha = config.get("lora_alpha")
    if alpha is None or alpha == lora.alpha:
        return None
    return (f"its lora_alpha is {alpha}, lora.alpha is {lora.alpha}", f"set lora.alpha={alpha} to match the adapter")


def _targets_problem(config: dict[str, Any], lora: Any) -> tuple[str, str] | None:
    recorded = config.get("target_modules")
    if isinstance(recorded, str):  # PEFT reads a string as a regular expression over module paths
        return (f"its target_modules is the pattern {recorded!r}, not a list of module names",
                "give an adapter whose target_modules is a list of names")
    theirs, ours = _as_set(recorded), set(lora.target_modules)
    if theirs == ours:
        return None
    return (f"its target modules are {sorted(theirs)}, lora.target_modules is {sorted(ours)}",
            f"set lora.target_modules=[{','.join(sorted(theirs))}] to match the adapter")


def _unsupported_problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for key, off, what in UNSUPPORTED:
        value = config.get(key, off)
        if value not in (off, None, False, {}, []):
            found.append((f"it uses {what} ({key}={value!r}), which lowmem_grpo's LoRA does not train",
                          "give a plain LoRA adapter"))
    return found


def _as_set(value: Any) -> set[str]:
    """PEFT saves target_modules as a list (from a list or a set); None means none recorded."""
    return {str(v) for v in value} if isinstance(value, (list, tuple, set)) else set()


# --- base model names ---------------------------------------------------------------------------------------------

def same_base(recorded: str, model_name: str, model_path: str) -> bool:
    """Whether an adapter's recorded base model is the recipe's model, under any of the names it goes by."""
    wanted = [model_name, model_path]
    if any(_same_path(recorded, name) for name in wanted):
        return True
    # the embedded model's cache folder under another $LOWMEM_GRPO_CACHE or home: the same conversion
    if is_embedded(model_name) and Path(recorded).name == model_name[len(PREFIX):]:
        return True
    theirs, ours = model_aliases(recorded), set().union(*(model_aliases(name) for name in wanted))
    return bool(theirs & ours) or any(_unsloth_upload(a, b) for a in theirs for b in ours)


def _same_path(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.rstrip("/").lower() == b.rstrip("/").lower()  # hub ids: the hub resolves them case-insensitively


def model_aliases(name: str) -> set[str]:
    """Lower-cased names of the same weights in Unsloth's table: the name, its 4-bit upload and every name mapped
    to that upload (the original org's name among them)."""
    name = name.rstrip("/").lower()
    aliases = {name}
    int_to_float, float_to_int = unsloth_name_tables()
    keys = {k for k in (name if name in int_to_float else None, float_to_int.get(name)) if k}
    for key in keys:  # one hop only: a few odd table entries must not chain model families together
        aliases |= {key, int_to_float[key].lower(), *(v for v, k in float_to_int.items() if k == key)}
    return aliases


def _unsloth_upload(a: str, b: str) -> bool:
    """`unsloth/X[-bnb-4bit]` and `<org>/X`: Unsloth's re-upload of a model its table does not (yet) list."""
    (org_a, _, base_a), (org_b, _, base_b) = a.partition("/"), b.partition("/")
    if "unsloth" not in (org_a, org_b) or not (base_a and base_b):
        return False
    return _strip_suffix(base_a) == _strip_suffix(base_b)


def _strip_suffix(base: str) -> str:
    for suffix in UNSLOTH_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


@functools.lru_cache(maxsize=1)
def unsloth_name_tables() -> tuple[dict[str, str], dict[str, str]]:
    """Unsloth's (4-bit upload -> 16-bit name, any name -> 4-bit upload) tables, lower-cased, from the installed
    unsloth/models/mapper.py (plain dicts, no imports), without importing Unsloth: importing it patches
    transformers process-wide, which an hf run must not get. Empty tables when Unsloth is not installed."""
    try:
        spec = importlib.util.find_spec("unsloth")  # locates the package without importing it
        folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        if folder is None or not (folder / "models" / "mapper.py").is_file():
            return {}, {}
        mapper_spec = importlib.util.spec_from_file_location("_lowmem_unsloth_mapper", folder / "models" / "mapper.py")
        mapper = importlib.util.module_from_spec(mapper_spec)
        mapper_spec.loader.exec_module(mapper)
        return ({k.lower(): str(v) for k, v in mapper.INT_TO_FLOAT_MAPPER.items()},
                {k.lower(): str(v).lower() for k, v in mapper.FLOAT_TO_INT_MAPPER.items()})
    except Exception as exc:  # a changed table layout must not stop training: fall back to plain names
        log.debug("could not read Unsloth's model name table: %s", exc)
        return {}, {}
