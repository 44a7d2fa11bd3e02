"""The base model an adapter names in its adapter_config.json: the model the user trained, not the repo Unsloth
loaded in its place."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

QUANTIZED_SUFFIX = "-bnb-4bit"


def original_base(recorded: str, base_name: str | None) -> str:
    """The base model an adapter should name. Unsloth loads a 4-bit base from its own pre-quantized repo
    (unsloth/<Name>-unsloth-bnb-4bit, through unsloth/models/mapper.py) and PEFT records that repo as
    base_model_name_or_path; the model the user trained is the recipe's (`base_name`). Other names are kept."""
    if not (recorded.startswith("unsloth/") and recorded.endswith(QUANTIZED_SUFFIX)):
        return recorded
    if base_name and not base_name.endswith(QUANTIZED_SUFFIX) and ":" not in base_name:
        return base_name
    return recorded.removesuffix("-unsloth" + QUANTIZED_SUFFIX).removesuffix(QUANTIZED_SUFFIX)  # Unsloth's 16-bit


def name_original_base(adapter_dir: Path, base_name: str | None) -> str | None:
    """Rewrite adapter_dir/adapter_config.json to name the original base model (original_base); returns the
    name written, or None when there was nothing to change."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    recorded = config.get("base_model_name_or_path") or ""
    name = original_base(recorded, base_name)
    if name == recorded:
        return None
    config["base_model_name_or_path"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log.info("adapter_config.json names %s as its base (it said %s)", name, recorded)
    return name
