"""The CPU attention (lowmem_grpo.sampling.attention): the float32 matmul attention equals PyTorch's SDPA in float32
(values and gradients), is as accurate as SDPA's flash kernel for CPU in bfloat16, stays finite on fully masked rows,
and is what a bfloat16 model on CPU runs inside cpu_attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from lowmem_grpo.sampling.attention import (  # noqa: E402
    CPU_ATTENTION,
    cpu_attention,
    low_precision_cpu,
    matmul_attention,
)

HEADS, KV_HEADS, DIM = 6, 2, 16


def _inputs(batch: int, q_len: int, k_len: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, q_len, DIM, generator=g) * 2
    k = torch.randn(batch, KV_HEADS, k_len, DIM, generator=g) * 2
    v = torch.randn(batch, KV_HEADS, k_len, DIM, generator=g)
    # left padding of a different width per row, causal within the last q_len positions
    mask = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool)
    for b in range(batch):
        mask[b, :, :, :b] = False
    mask &= torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def _sdpa(q, k, v, mask, **kw):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, **kw)


@pytest.mark.parametrize("q_len,k_len", [(1, 9), (5, 12), (7, 7)])
def test_matmul_attention_equals_sdpa_in_float32_with_grouped_heads_and_padding(q_len, k_len):
    q, k, v, mask = _inputs(3, q_len, k_len)
    seen = mask.any(-1).squeeze(1)  # (batch, q): positions that see a key (SDPA leaves the others undefined)
    ours = matmul_attention(q, k, v, mask, None, is_causal=False)
    assert ours.shape == (3, HEADS, q_len, DIM) and ours.dtype == torch.float32
    assert torch.allclose(ours.transpose(1, 2)[seen], _sdpa(q, k, v, mask).transpose(1, 2)[seen], atol=1e-5,
                          rtol=1e-5)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert torch.allclose(matmul_attention(q, k, v, additive, 0.3, False).transpose(1, 2)[seen],
                          _sdpa(q, k, v, mask, scale=0.3).transpose(1, 2)[seen], atol=1e-5, rtol=1e-5)


def test_no_mask_is_causal_aligned_to_the_last_key():
    q, k, v, _ = _inputs(2, 4, 10)
    causal = torch.ones(4, 10, dtype=torch.bool).tril(6)
    assert torch.allclose(matmul_attention(q, k, v, None, None, is_causal=True), _sdpa(q, k, v, causal), atol=1e-5)
    assert torch.allclose(matmul_attention(q, k, v, None, None, is_causal=False), _sdpa(q, k, v, None), atol=1e-5)


def test_gradients_equal_sdpas_in_float32():
    q, k, v, mask = _inputs(3, 6, 11)  # every position sees a key
    weights = torch.randn(3, HEADS, 6, DIM, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (lambda a, b, c: matmul_attention(a, b, c, mask, None, False), lambda a, b, c: _sdpa(a, b, c, mask)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        (fn(*leaves) * weights).sum().backward()
        grads.append([t.grad for t in leaves])
    for ours, theirs in zip(*grads):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_len,k_len", [(1, 40), (16, 40)])
def test_bfloat16_is_as_accurate_as_the_flash_kernel(q_len, k_len):
    q, k, v, mask = _inputs(4, q_len, k_len, seed=3)
    exact = _sdpa(q.double(), k.double(), v.double(), mask)
    b = [t.bfloat16() for t in (q, k, v)]
    ours = matmul_attention(*b, mask, None, False)
    flash = F.scaled_dot_product_attention(*b, attn_mask=mask, enable_gqa=True)
    assert ours.dtype == torch.bfloat16
    ours_err = (ours.double() - exact).abs().max().item()
    flash_err = (flash.double() - exact).abs().max().item()
    assert ours_err <= 1.05 * flash_err + 1e-6, (ours_err, flash_err)


def test_fully_masked_rows_stay_finite_in_values_and_gradients():
    q, k, v, mask = _inputs(2, 5, 5)
    mask[1, :, :2, :] = False  # a left-padded row's first positions see no key at all
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = matmul_attention(*leaves, mask, None, False)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)


def test_only_low_precision_cpu_tensors_take_the_matmul_path():
    assert low_precision_cpu(torch.zeros(1, dtype=torch.bfloat16))
    assert low_precision_cpu(torch.zeros(1, dtype=torch.float16))
    assert not low_precision_cpu(torch.zeros(1))


def _ops(model, batch) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(**batch)
    return {e.key for e in prof.key_averages()}


def test_a_bfloat16_model_runs_the_matmul_attention_inside_cpu_attention_and_switches_back(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = tokenizer(["a b c d e f", "a b"], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        plain = model(**batch).logits.float()
    assert any("scaled_dot_product" in op for op in _ops(model, batch))  # sdpa's own kernel
    with cpu_attention(model) as switched:
        assert switched and model.config._attn_implementation == CPU_ATTENTION
        assert not any("scaled_dot_product" in op for op in _ops(model, batch))
        with torch.no_grad():
            ours = model(**batch).logits.float()
    assert model.config._attn_implementation == "sdpa"
    real = batch["attention_mask"].bool()
    # the same function up to bfloat16 rounding, at every position a real token holds
    assert (ours - plain)[real].abs().max().item() < 0.05 * plain[real].abs().max().item()


def test_cpu_attention_off_leaves_transformers_sdpa(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_grpo.recipe import CpuConfig, TrainConfig
    from lowmem_grpo.runtime import cpu_paths
    from lowmem_grpo.sampling.generate import generate

    assert cpu_paths(TrainConfig(), "cpu").attention is True  # on by default, on a CPU
    assert cpu_paths(TrainConfig(cpu=CpuConfig(fast=False)), "cpu").attention is False
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = []
    with cpu_attention(model, enabled=False) as switched:
        seen.append((switched, model.config._attn_implementation))
    assert seen == [(False, "sdpa")]
    from torch.profiler import ProfilerActivity, profile

    for attention, flash in ((False, True), (True, False)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, tokenizer, ["a b c", "a"], max_new_tokens=3, batch_size=2, progress=False,
                     attention=attention)
        assert any("scaled_dot_product" in e.key for e in prof.key_averages()) == flash


def test_a_bfloat16_decode_keeps_its_cache_in_float32_and_writes_the_same_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_grpo.sampling.attention import cache_dtype
    from lowmem_grpo.sampling.engine import DecodeContract, sample_rows
    from lowmem_grpo.sampling.kv_cache import PreallocatedLayer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = tokenizer(["a b c d e f", "a b", "c d e"])["input_ids"]
    assert cache_dtype(model) is None  # transformers' own attention reads the model's dtype
    rows = {}
    with torch.inference_mode(), cpu_attention(model):
        assert cache_dtype(model) == torch.float32
        for preallocate in (True, False):  # float32 preallocated cache vs transformers' DynamicCache (bfloat16)
            rows[preallocate] = [r.ids for r in sample_rows(
                model, prompts, max_new_tokens=12, temperature=0.0, eos_ids={tokenizer.eos_token_id},
                pad_id=tokenizer.pad_token_id, contract=DecodeContract(preallocate=preallocate))]
    assert cache_dtype(model) is None
    assert rows[True] == rows[False]
    k = torch.randn(2, 1, 3, 4, dtype=torch.bfloat16)
    keys, _ = PreallocatedLayer(8, torch.float32).update(k, k)
    assert keys.dtype == torch.float32 and torch.equal(keys, k.float())
