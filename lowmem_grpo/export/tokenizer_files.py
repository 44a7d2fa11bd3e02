"""Tokenizer files that llama.cpp's converter reads as the tokenizer they are (docs/runs.md, GGUF).

transformers builds the fast tokenizer of a model loaded from a GGUF file by architecture (ggml.py
GGUF_TO_FAST_CONVERTERS: "llama" -> GGUFLlamaConverter), so a byte-level BPE such as SmolLM2's is saved with
`byte_fallback: true` and a decoder Sequence around ByteLevel. convert_hf_to_gguf.py takes any BPE tokenizer.json with
byte_fallback and a Sequence decoder for `LlamaHfVocab` (`tokenizer.ggml.model = llama`), and llama.cpp then aborts on
the first byte without a `<0xNN>` token. In a byte-level BPE byte fallback never fires, so `repair_byte_level_bpe`
writes what the hub tokenizer says (byte_fallback off, the plain ByteLevel decoder) and checks that encoding and
decoding are unchanged; the converter then takes its GPT-2 path and hashes the pre-tokenizer to `smollm`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
"""The decoder `tokenizers` writes for a byte-level BPE (what GPT-2 and SmolLM2's hub tokenizer.json hold)."""
BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
CHECK_TEXTS = (
    "Tom has 3 apples and buys 12 more: <<3+12=15>>15.\n#### 15",
    "\n \n\n \t\t  leading spaces, ÄÖÜ é 日本語 🦙🚀 ''' \"\"\" ... !!! 3.3 33333333",
    "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n",
)
"""Texts whose ids and decoded text must not change when the tokenizer files are repaired."""


def _has_byte_level(part: Any) -> bool:
    """True when a pre-tokenizer (or a Sequence of them) includes ByteLevel."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in part.get("pretokenizers") or [])


def needs_repair(tokenizer_json: dict[str, Any]) -> bool:
    """A byte-level BPE tokenizer.json that llama.cpp's converter would take for a SentencePiece-style Llama vocabulary:
    BPE with byte_fallback on and a ByteLevel pre-tokenizer, and no `<0xNN>` byte tokens for the fallback to use."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return False
    if not _has_byte_level(tokenizer_json.get("pre_tokenizer")):
        return False
    return not any(BYTE_TOKEN.match(token) for token in model.get("vocab") or {})


def _round_trips(path: Path) -> list[tuple[list[int], str]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    ids = [tok.encode(text, add_special_tokens=False).ids for text in CHECK_TEXTS]
    return [(i, tok.decode(i, skip_special_tokens=False)) for i in ids]


def repair_byte_level_bpe(folder: str | Path) -> bool:
    """Rewrite folder/tokenizer.json with byte_fallback off and the plain ByteLevel decoder when `needs_repair`;
    returns whether it changed. The rewrite is kept only if every CHECK_TEXTS entry encodes to the same ids and
    decodes to the same text as before."""
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
