"""Tiny models built from a config in the tests: a small byte-level BPE tokenizer and a 2-layer model.

Nothing is downloaded: the tokenizer is trained on the embedded GSM8K sample, the weights are random.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REPO = Path(__file__).resolve().parents[1]


def build_tokenizer(target: Path, vocab_size: int = 600):
    """Train a byte-level BPE tokenizer on the embedded sample and save it as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for split in ("train", "test"):
        for line in (REPO / "lowmem_grpo/resources/gsm8k" / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            texts += [row["question"], row["answer"]]
    texts += ["<reasoning>\n", "</reasoning>\n", "<answer>\n", "</answer>"] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)
    return fast


def build_tiny_model(target: Path, arch: str = "llama") -> Path:
    """A 2-layer, 64-wide causal LM (llama or qwen2 architecture) with the tiny tokenizer, saved to `target`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(target)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tie_word_embeddings=True)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    return target
