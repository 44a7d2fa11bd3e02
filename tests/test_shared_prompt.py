"""The shared-prompt log-prob pass equals the full-row pass (log-probs, entropies, LoRA gradients) and really
forwards each distinct prompt once; a GRPO run with it on equals one with it off step by step."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tiny import build_tiny_model
from tiny_run import train_tiny

P, C = 14, 9  # prompt width (left-padded) and completion width of the synthetic batches


def _peft_model(model_dir):
    """The tiny model in float32 with a LoRA adapter whose B is non-zero (so every LoRA weight gets a gradient)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                             init_lora_weights=False))
    model.train()
    return model


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    return {"llama": _peft_model(tiny_model_dir),
            "qwen2": _peft_model(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2"))}


def _batch(prompt_lengths, group_size, vocab, seed):
    """Rows as TRL builds them: each prompt left-padded to P, repeated group_size times, each followed by a
    right-padded completion of its own length; the rows shuffled (a group need not be contiguous)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for length in prompt_lengths:
        prompt = torch.randint(3, vocab, (length,), generator=gen)
        for _ in range(group_size):
            completion = torch.randint(3, vocab, (C,), generator=gen)
            kept = int(torch.randint(1, C + 1, (1,), generator=gen))
            ids.append(torch.cat([torch.zeros(P - length, dtype=torch.long), prompt, completion]))
            mask.append(torch.cat([torch.zeros(P - length, dtype=torch.long), torch.ones(length, dtype=torch.long),
                                   (torch.arange(C) < kept).long()]))
    order = torch.randperm(len(ids), generator=gen)
    return torch.stack(ids)[order], torch.stack(mask)[order]


def _pass(model, ids, mask, share, micro_batches=1):
    """Per-token log-probs and entropies of every row, the LoRA gradients of a masked log-prob sum accumulated
    over `micro_batches` consecutive slices (gradient accumulation: a group may straddle two), and the token
    positions forwarded."""
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    from lowmem_grpo.train.shared_prompt import completion_logits

    model.zero_grad()
    logps, entropies, forwarded, shared = [], [], 0, []
    for rows in torch.arange(ids.size(0)).chunk(micro_batches):
        out = completion_logits(model, ids[rows], mask[rows], C, share=share)
        lp = selective_log_softmax(out.logits.float(), ids[rows, -C:])
        (lp * mask[rows, -C:]).sum().div(micro_batches).backward()
        logps.append(lp.detach())
        entropies.append(entropy_from_logits(out.logits.detach().float()))
        forwarded += out.tokens_forwarded
        shared.append(out.shared)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return torch.cat(logps), torch.cat(entropies), grads, forwarded, shared


def _assert_equal_passes(full, shared_pass, mask):
    real = mask[:, -C:].bool()
    assert (full[0] - shared_pass[0])[real].abs().max().item() <= 1e-5
    assert (full[1] - shared_pass[1])[real].abs().max().item() <= 1e-5
    assert full[2].keys() == shared_pass[2].keys() and len(full[2]) > 0
    for name, grad in full[2].items():
        assert grad.norm() > 0, name
        assert ((grad - shared_pass[2][name]).norm() / grad.norm()).item() <= 1e-4, name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("group_size,prompt_lengths", [(2, [14]), (2, [14, 5, 9, 11]), (4, [7, 14]),
                                                        (4, [3, 14, 10]), (8, [14]), (8, [14, 6, 12, 9])])
def test_shared_pass_equals_full_rows(models, arch, group_size, prompt_lengths):
    model = models[arch]
    ids, mask = _batch(prompt_lengths, group_size, model.config.vocab_size, seed=group_size * 10 + len(prompt_lengths))
    full = _pass(model, ids, mask, share=False)
    shared = _pass(model, ids, mask, share=True)
    _assert_equal_passes(full, shared, mask)
    rows = ids.size(0)
    assert full[3] == rows * (P + C) and full[4] == [False]
    # each distinct prompt ran once: the proof that rows really shared it
    assert shared[3] == len(prompt_lengths) * P + rows * C and shared[4] == [True]


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_gradient_accumulation_with_groups_split_across_micro_batches(models, micro_batches):
    model = models["llama"]
    ids, mask = _batch([14, 8, 11], 4, model.config.vocab_size, seed=micro_batches)
    full = _pass(model, ids, mask, share=False, micro_batches=micro_batches)
    shared = _pass(model, ids, mask, share=True, micro_batches=micro_batches)
    _assert_equal_passes(full, shared, mask)
    assert shared[3] < full[3]


def test_no_shared_prompt_runs_the_full_rows(models):
    from lowmem_grpo.train.shared_prompt import completion_logits, prompt_groups

    model = models["llama"]
    ids, mask = _batch([14, 9, 5], 1, model.config.vocab_size, seed=3)
    assert prompt_groups(ids, mask, P) is None
    out = completion_logits(model, ids, mask, C, share=True)
    assert not out.shared and out.tokens_forwarded == ids.numel()


def test_prompt_groups_compare_ids_and_mask_and_number_by_first_appearance():
    import torch

    from lowmem_grpo.train.shared_prompt import prompt_groups

    ids = torch.tensor([[0, 5, 6, 1], [0, 5, 6, 2], [7, 5, 6, 3], [0, 5, 6, 4], [7, 5, 6, 5]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    first, inverse = prompt_groups(ids, mask, 3)
    # rows 0/1 share ids and mask; row 3 has row 0's ids but another mask; rows 2/4 share
    assert first.tolist() == [0, 2, 3] and inverse.tolist() == [0, 0, 1, 2, 1]


def test_where_it_does_not_apply(models):
    from transformers import Qwen2Config

    from lowmem_grpo.train.shared_prompt import checkpointing_active, unsupported

    model = models["llama"]
    assert unsupported(model) is None and not checkpointing_active(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert checkpointing_active(model)
        model.eval()
        assert not checkpointing_active(model)  # no recompute outside training: the cache is kept
    finally:
        model.gradient_checkpointing_disable()
        model.train()
    sliding = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=100, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1)
    assert "sliding-window" in unsupported(SimpleNamespace(config=sliding))


# ---- through the trainer -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(models, tiny_model_dir, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trainer")), use_cpu=True, bf16=False,
                      per_device_train_batch_size=8, num_generations=4, temperature=0.7, report_to=[],
                      gradient_checkpointing=False)
    return CpuSafeGRPOTrainer(model=models["llama"], reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=args, train_dataset=Dataset.from_list([{"prompt": "a"}] * 8),
                              processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.mark.parametrize("batch_size", [None, 5, 8])
def test_trainer_pass_shares_prompts_in_every_chunk(trainer, batch_size):
    import torch

    ids, mask = _batch([14, 6, 10, 12], 4, trainer.model.config.vocab_size, seed=11)
    results = {}
    for share in (False, True):
        trainer.lowmem_shared_prompt = share
        trainer._metrics["train"].clear()
        trainer.model.zero_grad()
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, batch_size=batch_size, compute_entropy=True)
        (logps * mask[:, -C:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results[share] = (logps.detach(), entropies.detach(), grads,
                          trainer._metrics["train"].get("shared_prompt/tokens_saved"))
    trainer.lowmem_shared_prompt = True
    _assert_equal_passes(results[False], results[True], mask)
    assert results[False][3] is None  # off: nothing logged
    saved = results[True][3]
    assert saved is not None and 0.0 < saved[0] < 1.0
    rows = ids.size(0)
    if batch_size is None:  # one chunk of 16 rows, 4 prompts
        assert saved[0] == pytest.approx(1 - (4 * P + rows * C) / (rows * (P + C)))
    # the temperature divides the logits (TRL's definition): at T=1 the log-probs differ
    trainer.temperature = 1.0
    try:
        with torch.no_grad():
            plain, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    finally:
        trainer.temperature = 0.7
    assert (plain - results[True][0]).abs().max() > 1e-3


def test_trainer_status_names_the_reason(trainer):
    assert trainer.shared_prompt_status()[0] is True
    trainer.lowmem_shared_prompt = False
    try:
        assert trainer.shared_prompt_status() == (False, "train.shared_prompt is false")
    finally:
        trainer.lowmem_shared_prompt = True


# ---- a GRPO run --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_with_shared_prompt_equals_run_without(tiny_model_dir, tmp_path):
    # float32; 1.5 groups per micro-batch (TRL shuffles the rows), accumulation 2, generation every 4 micro-batches
    # (so TRL runs the old log-prob pass too) and beta > 0 (the reference pass)
    settings = ["model.dtype=float32", "prime.enabled=false", "train.preflight=false", "train.max_steps=3",
                "train.num_generations=4", "train.per_device_train_batch_size=6",
                "train.gradient_accumulation_steps=2", "train.steps_per_generation=4", "train.beta=0.04",
                "train.save_steps=10", "train.completions_every=0"]
    runs = {}
    for share in (True, False):
        run_dir, logs = train_tiny(tiny_model_dir, tmp_path / f"run-{share}", *settings,
                                   f"train.shared_prompt={str(share).lower()}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[share] = ([r for r in records if r.get("stage") == "grpo" and "loss" in r], logs.messages(logging.INFO))
    on, off = runs[True][0], runs[False][0]
    assert [r["step"] for r in on] == [r["step"] for r in off] == [1, 2, 3]
    for a, b in zip(on, off):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["kl"] - b["kl"]) <= 1e-5
        assert a["shared_prompt/tokens_saved"] > 0.2  # it really ran: a share of the prompt tokens was not run
        assert "shared_prompt/tokens_saved" not in b
    assert any(m.startswith("shared-prompt log-prob pass: on") for m in runs[True][1])
    assert "shared-prompt log-prob pass: off (train.shared_prompt is false)" in runs[False][1]
