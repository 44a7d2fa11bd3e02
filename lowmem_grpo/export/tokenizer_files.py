"""Tokenizer files that llama.cpp's converter reads as the tokenizer they are (docs/runs.md, GGUF): transformers
saves a byte-level BPE loaded from GGUF (SmolLM2's) with byte_fallback on and a Sequence decoder, which
convert_hf_to_gguf.py takes for a SentencePiece vocabulary, on which llama.cpp aborts."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
# the decoder `tokenizers` writes for a byte-level BPE (GPT-2's and SmolLM2's hub tokenizer.json)
BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# texts whose ids and decoded text must not change when the tokenizer files are repaired
CHECK_TEXTS = (
    "Tom has 3 apples and buys 12 more: <<3+12=15>>15.\n#### 15",
    "\n \n\n \t\t  leading spaces, ÄÖÜ é 日本語 🦙🚀 ''' \"\"\" ... !!! 3.3 33333333",
    "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n",
)


def _has_byte_level(part: Any) -> bool:
    """True when a pre-tokenizer (or a Sequence of them) includes ByteLevel."""
    return isinstance(part, dict) and (part.get("type") == "ByteLevel"
                                       or any(_has_byte_level(p) for p in part.get("pretokenizers") or []))


def needs_repair(tokenizer_json: dict[str, Any]) -> bool:
    """A BPE tokenizer.json with byte_fallback on, a ByteLevel pre-tokenizer and no `<0xNN>` byte tokens for the
    fallback to use: the converter would take it for a SentencePiece-style Llama vocabulary."""
    model = tokenizer_json.get("model") or {}
    return (model.get("type") == "BPE" and bool(model.get("byte_fallback"))
            and _has_byte_level(tokenizer_json.get("pre_tokenizer"))
            and not any(BYTE_TOKEN.match(token) for token in model.get("vocab") or {}))


def _round_trips(path: Path) -> list[tuple[list[int], str]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    ids = [tok.encode(text, add_special_tokens=False).ids for text in CHECK_TEXTS]
    return [(i, tok.decode(i, skip_special_tokens=False)) for i in ids]


def repair_byte_level_bpe(folder: str | Path) -> bool:
    """Rewrite folder/tokenizer.json with byte_fallback off and the plain ByteLevel decoder when `needs_repair`, kept
    only if CHECK_TEXTS encode and decode as before; returns whether it changed."""
    path = Path(folder) / TOKENIZER_JSON
    if not path.is_file():
        return False
    original = path.read_text(encoding="utf-8")
    data = json.loads(original)
    if not needs_repair(data):
        return False
    before = _round_trips(path)
    data["model"]["byte_fallback"] = False
    data["decoder"] = dict(BYTE_LEVEL_DECODER)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    after = _round_trips(path)
    if after != before:
        path.write_text(original, encoding="utf-8")
        log.warning("%s: turning byte fallback off would change tokenization; kept as it was (llama.cpp's "
                    "converter may read it as a SentencePiece vocabulary)", path)
        return False
    log.info("%s: byte-level BPE written without byte fallback, as llama.cpp's converter must see it", path)
    return True


def save_tokenizer(tokenizer: Any, folder: str | Path) -> None:
    """The tokenizer's files in `folder`, a byte-level BPE written as one (repair_byte_level_bpe)."""
    tokenizer.save_pretrained(str(folder))
    repair_byte_level_bpe(folder)
