"""The sampling engine against Unsloth's KV-cache contract, on CPU.

Unsloth's fast forward (CUDA only) is stood in for by tests/unsloth_fake.py::UnslothLikeLM, which mirrors the
installed unsloth functions it names (UNSLOTH_FUNCTIONS): the cache read as a tuple and never written, a returned
tuple of its own, and decode buffers sized by the batch at the first decode. The pin test below fails when any of
those functions' source changes, so the stand-in is re-read against the new code before the tests are trusted.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
from test_engine import PROMPTS, ScriptedLM, _enc, _ending_model, qwen2_dir, tokenizer  # noqa: F401 (fixtures)
from unsloth_fake import UNSLOTH_FUNCTIONS, DecodeGraphs, UnslothLikeLM

from lowmem_grpo.backends import is_unsloth_model
from lowmem_grpo.sampling.engine import (COMPACT_SHARE, GRAPHED_MODEL_TYPES, Calculator, DecodeContract,
                                         decode_contract, sample_rows)

PINNED = {
    ("models/llama.py", "_cache_as_legacy_tuple"): "3357ea73fd6644a1",
    ("models/llama.py", "CausalLM_fast_forward"): "812305b39bd982d4",
    ("models/llama.py", "LlamaAttention_fast_forward"): "094cf12525d4c0e0",
    ("models/llama.py", "LlamaAttention_fast_forward_inference"): "d7ba7f509c129a2a",
    ("models/llama.py", "_LlamaModel_fast_forward_inference"): "2d66e3b46e6e97ef",
    ("models/llama.py", "unsloth_fast_generate"): "fc7c3af4e242acd4",
    ("models/_decode_graphs.py", "alloc_decode_buffers"): "1ef491e03f8cde20",
    ("models/_decode_graphs.py", "resize_decode_buffers"): "f46f72badc3bf25f",
    ("models/_decode_graphs.py", "enabled"): "6a8f8063d2f55801",
    ("models/_decode_graphs.py", "_default_ok"): "3606055d5a012503",
    ("models/_decode_graphs.py", "rl_generation"): "3c2910bb2d379664",
    ("models/_decode_graphs.py", "start_generation"): "6d1ffd68c03f1b96",
    ("models/_decode_graphs.py", "end_generation"): "5f883eea1989fca7",
    ("models/_decode_graphs.py", "release"): "3447f913ec79ba90",
    ("models/_decode_graphs.py", "release_for_training"): "42c9cd7e4d9d8526",
}
"""sha256 (first 16 hex digits) of each mirrored function's source in unsloth 2026.10.9."""


def _unsloth_sources() -> dict[tuple[str, str], str]:
    """The mirrored functions' source text, read from the installed files (unsloth is not imported: on a CPU its
    import swaps in the stock-transformers fallback and patches libraries)."""
    spec = importlib.util.find_spec("unsloth")
    assert spec is not None and spec.submodule_search_locations, "unsloth is not installed"
    root = Path(spec.submodule_search_locations[0])
    sources = {}
    for file, names in UNSLOTH_FUNCTIONS.items():
        text = (root / file).read_text()
        defs = {n.name: n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for name in names:
            assert name in defs, f"unsloth/{file} no longer defines {name}"
            sources[(file, name)] = ast.get_source_segment(text, defs[name])
    return sources


def test_the_mirrored_unsloth_functions_are_the_pinned_ones():
    sources = _unsloth_sources()
    assert set(sources) == set(PINNED)
    changed = [f"unsloth/{file}::{name}" for (file, name), src in sources.items()
               if hashlib.sha256(src.encode()).hexdigest()[:16] != PINNED[(file, name)]]
    assert not changed, (f"{changed} changed: re-read them against tests/unsloth_fake.py and the engine's "
                         "DecodeContract, then update PINNED")
    # the lines of the contract, spelled out so that a failure says which part moved
    assert "past_key_values = _cache_as_legacy_tuple(past_key_values)" in sources[("models/llama.py",
                                                                                    "CausalLM_fast_forward")]
    assert "if past_len == 0:\n        return None" in sources[("models/llama.py", "_cache_as_legacy_tuple")]
    assert 'do_prefill = not hasattr(decoder_layer.self_attn, "paged_attention")' in sources[
        ("models/llama.py", "_LlamaModel_fast_forward_inference")]
    inference = sources[("models/llama.py", "LlamaAttention_fast_forward_inference")]
    assert "seq_len = K1.shape[-2]" in inference
    assert "self.paged_attention_K[seq_len].view(bsz, 1, n_kv_heads * head_dim)" in inference
    assert "del self.paged_attention_K" in sources[("models/llama.py", "LlamaAttention_fast_forward")]
    generate = sources[("models/llama.py", "unsloth_fast_generate")]
    assert "del module.paged_attention_K, module.paged_attention_V, module.paged_attention" in generate
    assert "torch.autocast(device_type = DEVICE_TYPE_TORCH, dtype = dtype)" in generate
    assert 'os.environ.get("UNSLOTH_DECODE_CUDA_GRAPHS", "")' in sources[("models/_decode_graphs.py", "enabled")]
    assert 'return _DEFAULT_OK and getattr(_TLS, "rl_depth", 0) > 0' in sources[("models/_decode_graphs.py",
                                                                               "enabled")]
    # the families the engine hands to Unsloth's graphed decode are the ones it graphs
    root = Path(importlib.util.find_spec("unsloth").submodule_search_locations[0])
    graphs_source = (root / "models" / "_decode_graphs.py").read_text()
    supported = re.search(r"^_SUPPORTED_MODEL_TYPES = (\{.*\})$", graphs_source, re.M)
    assert supported and ast.literal_eval(supported.group(1)) == set(GRAPHED_MODEL_TYPES)
    assert "_decode_graphs.release_for_training(self)" in generate  # what Unsloth's RL generate does after it


def _settings(tokenizer, max_new_tokens: int) -> dict:
    return dict(max_new_tokens=max_new_tokens, temperature=0.0, eos_ids={tokenizer.eos_token_id},
                pad_id=tokenizer.pad_token_id)


def test_the_stand_in_is_recognised_as_unsloth(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert not is_unsloth_model(plain) and not decode_contract(plain).fixed_batch
    fake = UnslothLikeLM(plain)
    assert is_unsloth_model(fake)
    contract = decode_contract(fake)
    assert contract.fixed_batch and contract.autocast is None  # autocast is for CUDA only


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_rows_through_unsloths_contract_equal_the_plain_models(arch, tiny_model_dir, qwen2_dir, tokenizer):
    """Left-padded prompts of different lengths, rows that end at different steps (enough for the plain model's
    batch to shrink), a decode that crosses a buffer growth: the same ids as the plain model, in one fixed
    batch."""
    model_dir = tiny_model_dir if arch == "llama" else qwen2_dir
    max_new = 16
    plain, ref = _ending_model(model_dir, tokenizer, max_new)
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    assert len({len(p) for p in prompt_ids}) > 3
    fake = UnslothLikeLM(plain)
    rows = sample_rows(fake, prompt_ids, **_settings(tokenizer, max_new))
    assert [r.ids for r in rows] == [r.ids for r in ref]
    assert [r.truncated for r in rows] == [r.truncated for r in ref]
    ended = sum(not r.truncated for r in rows)
    assert ended >= math.ceil(COMPACT_SHARE * len(rows))  # the plain model's batch would have shrunk
    kinds = [kind for _, _, kind in fake.forwards]
    assert kinds[0] == "prefill" and set(kinds[1:]) == {"decode"}
    assert {rows_ for rows_, _, kind in fake.forwards if kind == "decode"} == {len(PROMPTS)}  # fixed batch
    assert not any(hasattr(a, "paged_attention") for a in fake.attn)  # buffers released after the loop
    assert fake.graph_modes == {"0"}  # Unsloth's eager decode step, whatever the caller's setting


def test_the_callers_cuda_graph_setting_is_put_back(tiny_model_dir, tokenizer):
    """The loop holds Unsloth's CUDA-graph decode off while it runs (its graphs size persistent buffers for the
    generate() calls Unsloth wraps) and leaves the variable as it found it, set or unset. The test's own
    process environment is changed only inside a `with` that restores it."""
    import os
    from unittest import mock

    from transformers import AutoModelForCausalLM

    fake = UnslothLikeLM(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    ids = tokenizer(PROMPTS[:2])["input_ids"]
    for value in (None, "1"):
        env = {} if value is None else {"UNSLOTH_DECODE_CUDA_GRAPHS": value}
        with mock.patch.dict(os.environ, env, clear=False):
            if value is None:
                os.environ.pop("UNSLOTH_DECODE_CUDA_GRAPHS", None)
            sample_rows(fake, ids, **_settings(tokenizer, 3))
            assert os.environ.get("UNSLOTH_DECODE_CUDA_GRAPHS") == value
    assert fake.graph_modes == {"0"}


def test_the_loop_decodes_through_unsloths_graphs_where_they_serve_it(tiny_model_dir, tokenizer):
    """With Unsloth's decode-graph module in the contract (an Unsloth model of a graphed family on CUDA), the loop
    runs as Unsloth's RL generation: graphs on unless UNSLOTH_DECODE_CUDA_GRAPHS=0, buffers sized for prompt +
    budget, released for training afterwards; rows as the plain model's, a second call with another batch too.
    The environment is changed only inside a `with` that restores it."""
    import os
    from unittest import mock

    max_new = 6
    plain, ref = _ending_model(tiny_model_dir, tokenizer, max_new)
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    graphs = DecodeGraphs(cuda=True)
    fake = UnslothLikeLM(plain, graphs)
    contract = DecodeContract(fixed_batch=True, preallocate=False, graphs=graphs)
    with mock.patch.dict(os.environ, {}, clear=False):
        os.environ.pop("UNSLOTH_DECODE_CUDA_GRAPHS", None)
        rows = sample_rows(fake, prompt_ids, contract=contract, **_settings(tokenizer, max_new))
        assert [r.ids for r in rows] == [r.ids for r in ref]
        assert fake.graphed and all(fake.graphed) and fake.graph_modes == {None}  # the user's setting untouched
        longest = max(len(p) for p in prompt_ids)
        assert graphs.events == ["rl_generation", f"start_generation({longest + max_new})", "end_generation",
                                 "release_for_training"]
        assert not any(hasattr(a, "paged_attention") or "_unsloth_graph_buffers" in a.__dict__ for a in fake.attn)
        assert graphs.rl_depth == 0 and graphs.hint == 0
        two = sample_rows(fake, prompt_ids[:2], contract=contract, **_settings(tokenizer, max_new))
        assert [r.ids for r in two] == [r.ids for r in ref[:2]]
        os.environ["UNSLOTH_DECODE_CUDA_GRAPHS"] = "0"  # the user's "off" wins inside the scope
        fake.graphed.clear()
        sample_rows(fake, prompt_ids, contract=contract, **_settings(tokenizer, max_new))
        assert fake.graphed and not any(fake.graphed)
    assert decode_contract(fake).graphs is None  # on a CPU: Unsloth's eager step, held off by the variable


def test_repeated_prompts_and_a_second_call_keep_the_contract(tiny_model_dir, tokenizer):
    """GRPO's groups (rows repeating a prompt share one prefill) and back-to-back calls with other batch sizes:
    the decode buffers of one call never leak into the next."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    fake = UnslothLikeLM(plain)
    a, b = tokenizer(["Natalia sold clips to 48", "How many"])["input_ids"]
    settings = _settings(tokenizer, 8)
    for batch in ([b, a, a, b, a], [a, b], [b, b, b]):
        fake.forwards.clear()
        got = [r.ids for r in sample_rows(fake, batch, **settings)]
        want = [r.ids for r in sample_rows(plain, batch, **settings)]
        assert got == want
        prefill, *decode = fake.forwards
        assert prefill[:2] == (len(set(map(tuple, batch))), max(map(len, batch)))
        assert all(call == (len(batch), 1, "decode") for call in decode)


def test_sampling_through_unsloths_contract_equals_the_plain_models(tiny_model_dir, tokenizer):
    """Seeded samples are the plain model's while both batches keep the same rows (a shrinking batch draws fewer
    uniforms per step, so the streams part once rows end)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    fake = UnslothLikeLM(plain)
    prompt_ids = tokenizer(PROMPTS[:4])["input_ids"]
    # no row ends (no EOS id is drawn from): both batches keep their rows, so both draw the same uniforms
    settings = dict(_settings(tokenizer, 10), temperature=1.0, eos_ids={-1})
    got = sample_rows(fake, prompt_ids, generator=torch.Generator().manual_seed(3), **settings)
    want = sample_rows(plain, prompt_ids, generator=torch.Generator().manual_seed(3), **settings)
    assert [r.ids for r in got] == [r.ids for r in want]


@pytest.fixture()
def scripted_fake(tokenizer):
    """A ScriptedLM behind Unsloth's contract: a row that opens `<<12-5=`, one that writes a bare `=`, and one
    that ends at once, so rows end at different steps while the calculator forces into another."""
    enc = lambda text: _enc(tokenizer, text)  # noqa: E731
    eos = tokenizer.eos_token_id
    result = enc("7>>")
    calls = enc("<<12-5=") + enc("9") * len(result) + enc(" apples") + [eos]
    plain = enc("12-5=7 apples") + [eos]
    short = enc("no") + [eos]
    scripts = {tuple(enc("Q: calls")): calls, tuple(enc("Q: plain")): plain, tuple(enc("Q: short")): short}
    expected = {
        "Q: calls": (enc("<<12-5=") + result + enc(" apples") + [eos],
                     [0] * len(enc("<<12-5=")) + [1] * len(result) + [0] * (len(enc(" apples")) + 1)),
        "Q: plain": (plain, [0] * len(plain)),
        "Q: short": (short, [0] * len(short)),
    }
    return UnslothLikeLM(ScriptedLM(scripts, len(tokenizer), eos)), expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_calculator_forces_its_result_through_unsloths_contract(scripted_fake, tokenizer, temperature):
    model, expected = scripted_fake
    order = ["Q: short", "Q: calls", "Q: plain", "Q: calls"]
    rows = sample_rows(model, [_enc(tokenizer, p) for p in order], max_new_tokens=30, temperature=temperature,
                       eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                       calculator=Calculator(tokenizer), generator=torch.Generator().manual_seed(0))
    for prompt, row in zip(order, rows):
        ids, forced = expected[prompt]
        assert row.ids == ids, prompt
        assert row.forced == forced, prompt
        assert not row.truncated
    assert {rows_ for rows_, _, kind in model.forwards if kind == "decode"} == {len(order)}
