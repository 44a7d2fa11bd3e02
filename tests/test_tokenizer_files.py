"""Tokenizer files an export writes: a byte-level BPE as transformers builds it from a GGUF file (byte fallback on,
a SentencePiece-style decoder) is written back as the plain byte-level BPE it is, with the same ids and text."""

from __future__ import annotations

import json
import re
from hashlib import sha256
from pathlib import Path

import pytest

from lowmem_grpo.export.tokenizer_files import BYTE_LEVEL_DECODER, needs_repair, repair_byte_level_bpe

SMOLLM_CHKHSH = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"
"""llama.cpp's pre-tokenizer hash for `smollm` (conversion/base.py get_vocab_base_pre, ref HuggingFaceTB/SmolLM-135M)."""
CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 '
          '333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
          '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
          '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
"""The text llama.cpp's converter encodes to tell pre-tokenizers apart (its `chktxt`)."""


@pytest.fixture(scope="module")
def saved_embedded_tokenizer(tmp_path_factory) -> Path:
    """The embedded SmolLM2 tokenizer as transformers builds it from the GGUF file and saves it (what a run's adapter
    folder and the old merged export held)."""
    from transformers import AutoTokenizer

    from lowmem_grpo.backends.embedded import gguf_location

    folder, name = gguf_location("smollm2-135m-instruct")
    target = tmp_path_factory.mktemp("embedded-tokenizer")
    AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained(str(target))
    return target


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_transformers_saves_the_embedded_tokenizer_with_byte_fallback(saved_embedded_tokenizer):
    data = json.loads((saved_embedded_tokenizer / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["type"] == "BPE" and data["model"]["byte_fallback"] is True
    assert data["decoder"]["type"] == "Sequence" and data["pre_tokenizer"]["type"] == "ByteLevel"
    assert needs_repair(data)


def test_repair_keeps_every_id_and_text_and_the_smollm_pre_tokenizer(saved_embedded_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    fixed = _copy(saved_embedded_tokenizer, tmp_path / "fixed")
    assert repair_byte_level_bpe(fixed) is True
    data = json.loads((fixed / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["byte_fallback"] is False and data["decoder"] == BYTE_LEVEL_DECODER
    assert not needs_repair(data) and repair_byte_level_bpe(fixed) is False  # idempotent
    before, after = AutoTokenizer.from_pretrained(str(saved_embedded_tokenizer)), AutoTokenizer.from_pretrained(str(fixed))
    texts = [CHKTXT, "<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>assistant\n<reasoning>\n<<12*7=84>>84",
             "ÄÖÜ é ▁ \u2581x 日本語 \x00\x7f 🦙"]
    for text in texts:
        ids = before.encode(text, add_special_tokens=False)
        assert after.encode(text, add_special_tokens=False) == ids
        assert after.decode(ids) == before.decode(ids) == text
    assert sha256(str(after.encode(CHKTXT)).encode()).hexdigest() == SMOLLM_CHKHSH


def test_a_bpe_with_byte_tokens_keeps_its_byte_fallback():
    data = {"model": {"type": "BPE", "byte_fallback": True, "vocab": {"<0x0A>": 0, "a": 1}},
            "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "Sequence", "decoders": []}}
    assert not needs_repair(data)  # a SentencePiece-converted vocabulary: the fallback is real
    data["model"]["vocab"] = {"a": 0}
    data["pre_tokenizer"] = {"type": "Metaspace"}
    assert not needs_repair(data)  # not byte-level


@pytest.mark.gguf
def test_converter_pin_llama_hf_vocab_takes_the_saved_tokenizer_and_not_the_repaired(saved_embedded_tokenizer, tmp_path):
    """The rule tokenizer_files works around, read from the converter `make install-gguf` keeps (gguf-py/gguf/vocab.py
    LlamaHfVocab): it accepts the tokenizer as transformers saves it and refuses the repaired one."""
    import subprocess
    import sys

    from lowmem_grpo.errors import BadInputError
    from lowmem_grpo.export.gguf_proof import find_converter

    try:
        gguf_py = find_converter().parent / "gguf-py"
    except BadInputError:
        pytest.skip("needs the gguf extra's converter (make install-gguf)")
    fixed = _copy(saved_embedded_tokenizer, tmp_path / "fixed")
    repair_byte_level_bpe(fixed)
    code = ("import sys\nfrom pathlib import Path\nfrom gguf.vocab import LlamaHfVocab\n"
            "for d in sys.argv[1:]:\n    try:\n        LlamaHfVocab(Path(d)); print('accepted')\n"
            "    except FileNotFoundError:\n        print('refused')\n")
    done = subprocess.run([sys.executable, "-c", code, str(saved_embedded_tokenizer), str(fixed)], text=True,
                          capture_output=True, env={"PYTHONPATH": str(gguf_py), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["accepted", "refused"]
    assert re.search(r"byte_fallback", (gguf_py / "gguf" / "vocab.py").read_text(encoding="utf-8"))
