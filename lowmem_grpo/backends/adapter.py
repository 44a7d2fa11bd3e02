"""The LoRA adapter a run starts from (`lora.init_adapter`), checked against the recipe before any model loads: its
base model, rank, alpha and target modules must be the recipe's, each mismatch named with the key that fixes it. Base
names match loosely: a folder and its resolved path, the embedded model's cache folder elsewhere, and Unsloth's
re-uploads (read from the installed Unsloth's name table without importing it)."""

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
QUANTIZED_SUFFIX = "-bnb-4bit"  # Unsloth's pre-quantized uploads end so (some in -unsloth-bnb-4bit)
# PEFT options a plain LoRA of the recipe cannot express: (config key, value meaning "off", what it is)
UNSUPPORTED = (("use_dora", False, "DoRA"), ("use_rslora", False, "rank-stabilized LoRA"),
               ("rank_pattern", {}, "per-module ranks"), ("alpha_pattern", {}, "per-module alphas"),
               ("modules_to_save", None, "fully trained extra modules"), ("bias", "none", "trained biases"))


def check_init_adapter(lora: Any, model_name: str, model_path: str) -> Path:
    """The adapter folder of `lora.init_adapter` when it fits the recipe, else BadInputError naming every mismatch
    and its fix. Reads two small files; loads no model."""
    spec = lora.init_adapter
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
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"lora.init_adapter {folder}: {ADAPTER_CONFIG} is unreadable ({exc})",
                            fix="copy the adapter folder whole") from exc
    if not isinstance(config, dict):
        raise BadInputError(f"lora.init_adapter {folder}: {ADAPTER_CONFIG} is not a JSON object",
                            fix="point it at a folder saved by PEFT's save_pretrained")
    problems = _problems(config, lora, model_name, model_path)
    if problems:
        raise BadInputError(f"lora.init_adapter {folder} does not fit the recipe: "
                            + "; ".join(problem for problem, _ in problems),
                            fix="; ".join(fix for _, fix in problems))
    log.info("starting from the LoRA adapter in %s (base %s, r=%s, modules %s)", folder,
             config.get("base_model_name_or_path"), config.get("r"), sorted(_as_set(config.get("target_modules"))))
    return folder


def _problems(config: dict[str, Any], lora: Any, model_name: str, model_path: str) -> list[tuple[str, str]]:
    """Each mismatch between the adapter's config and the recipe, with its fix."""
    found = []
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        found.append((f"it is a {kind} adapter, not LoRA", "give a LoRA adapter"))
    recorded = config.get("base_model_name_or_path")
    if not recorded:  # some tools leave it empty: nothing to compare, so say so and trust the user
        log.warning("lora.init_adapter names no base model; assuming it was trained on %s", model_name)
    elif not same_base(str(recorded), model_name, model_path):
        found.append((f"its base model is {recorded}, the recipe's is {model_name}",
                      f"set model.name={recorded} to match the adapter, or give an adapter trained on {model_name}"))
    rank = config.get("r")
    if rank != lora.r:
        found.append((f"its rank is {rank}, lora.r is {lora.r}",
                      f"set lora.r={rank} to match the adapter, or give an adapter of rank {lora.r}"))
    alpha = config.get("lora_alpha")  # alpha / r scales the adapter: another alpha starts from another model
    if alpha is not None and alpha != lora.alpha:
        found.append((f"its lora_alpha is {alpha}, lora.alpha is {lora.alpha}",
                      f"set lora.alpha={alpha} to match the adapter"))
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT reads a string as a regular expression over module paths
        found.append((f"its target_modules is the pattern {targets!r}, not a list of module names",
                      "give an adapter whose target_modules is a list of names"))
    elif _as_set(targets) != set(lora.target_modules):
        theirs = sorted(_as_set(targets))
        found.append((f"its target modules are {theirs}, lora.target_modules is {sorted(set(lora.target_modules))}",
                      f"set lora.target_modules=[{','.join(theirs)}] to match the adapter"))
    for key, off, what in UNSUPPORTED:
        value = config.get(key, off)
        if value not in (off, None, False, {}, []):
            found.append((f"it uses {what} ({key}={value!r}), which lowmem_grpo's LoRA does not train",
                          "give a plain LoRA adapter"))
    return found


def _as_set(value: Any) -> set[str]:
    """PEFT saves target_modules as a list (from a list or a set); None means none recorded."""
    return {str(v) for v in value} if isinstance(value, (list, tuple, set)) else set()


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
    to that upload."""
    name = name.rstrip("/").lower()
    aliases = {name}
    int_to_float, float_to_int = unsloth_name_tables()
    keys = {k for k in (name if name in int_to_float else None, float_to_int.get(name)) if k}
    for key in keys:  # one hop only: a few odd table entries must not chain model families together
        aliases |= {key, int_to_float[key].lower(), *(v for v, k in float_to_int.items() if k == key)}
    return aliases


def _unsloth_upload(a: str, b: str) -> bool:
    """`unsloth/X[-bnb-4bit]` and `<org>/X`: Unsloth's re-upload of a model its table does not list."""
    (org_a, _, base_a), (org_b, _, base_b) = a.partition("/"), b.partition("/")
    if "unsloth" not in (org_a, org_b) or not (base_a and base_b):
        return False
    return _unquantized(base_a) == _unquantized(base_b)


def _unquantized(name: str) -> str:
    return name.removesuffix("-unsloth" + QUANTIZED_SUFFIX).removesuffix(QUANTIZED_SUFFIX)


def original_base(recorded: str, base_name: str | None) -> str:
    """The base an adapter should name: Unsloth loads a 4-bit base from its own unsloth/<Name>-unsloth-bnb-4bit repo
    and PEFT records that; the model trained is the recipe's (`base_name`), else Unsloth's 16-bit repo."""
    if not (recorded.startswith("unsloth/") and recorded.endswith(QUANTIZED_SUFFIX)):
        return recorded
    if base_name and not base_name.endswith(QUANTIZED_SUFFIX) and ":" not in base_name:
        return base_name
    return _unquantized(recorded)


def name_original_base(adapter_dir: Path, base_name: str | None) -> None:
    """Rewrite adapter_dir/adapter_config.json to name the original base model (original_base)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    recorded = config.get("base_model_name_or_path") or ""
    name = original_base(recorded, base_name)
    if name != recorded:
        config["base_model_name_or_path"] = name
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        log.info("adapter_config.json names %s as its base (it said %s)", name, recorded)


@functools.lru_cache(maxsize=1)
def _unsloth_mapper() -> Any:
    """The installed unsloth/models/mapper.py (plain dicts) executed without importing Unsloth, which patches
    transformers process-wide; None when Unsloth is not installed or the file does not load."""
    try:
        spec = importlib.util.find_spec("unsloth")  # locates the package without importing it
        folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        if folder is None or not (folder / "models" / "mapper.py").is_file():
            return None
        mapper_spec = importlib.util.spec_from_file_location("_lowmem_unsloth_mapper", folder / "models" / "mapper.py")
        mapper = importlib.util.module_from_spec(mapper_spec)
        mapper_spec.loader.exec_module(mapper)
        return mapper
    except Exception as exc:  # a changed table layout must not stop training: fall back to plain names
        log.debug("could not read Unsloth's model name table: %s", exc)
        return None


@functools.lru_cache(maxsize=1)
def unsloth_name_tables() -> tuple[dict[str, str], dict[str, str]]:
    """Unsloth's (4-bit upload -> 16-bit name, any name -> 4-bit upload) tables, lower-cased (_unsloth_mapper).
    Empty when Unsloth is not installed."""
    mapper = _unsloth_mapper()
    try:
        return ({k.lower(): str(v) for k, v in mapper.INT_TO_FLOAT_MAPPER.items()},
                {k.lower(): str(v).lower() for k, v in mapper.FLOAT_TO_INT_MAPPER.items()})
    except AttributeError as exc:  # no table (or another layout): plain names
        log.debug("no Unsloth model name table: %s", exc)
        return {}, {}


def unsloth_4bit_upload(name: str) -> str | None:
    """The pre-quantized 4-bit upload FastLanguageModel loads for `name` with load_in_4bit (Unsloth's
    FLOAT_TO_INT_MAPPER, spelled as listed; a `-bnb-4bit` name is its own); None when its table lists none."""
    if name.lower().endswith(QUANTIZED_SUFFIX):
        return name
    table = getattr(_unsloth_mapper(), "FLOAT_TO_INT_MAPPER", None) or {}
    upload = {str(k).lower(): str(v) for k, v in table.items()}.get(name.rstrip("/").lower())
    return upload or None
