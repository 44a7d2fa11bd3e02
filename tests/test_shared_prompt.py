"""The shared-prompt log-prob pass equals the full-row pass (log-probs, entropies, LoRA gradients) and really
forwards each distinct prompt once; the CPU trainer's passes skip the completion padding exactly and forward fewer
token positions; a GRPO run with sharing on equals one with it off step by step."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from lowmem_grpo.runtime import CpuPaths
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


def _batch(prompt_lengths, group_size, vocab, seed, longest=None, width=C):
    """Rows as TRL builds them: each prompt left-padded to P, repeated group_size times, each followed by a
    completion of its own length (at most longest[i] for prompt i, `width` by default) right-padded to `width`;
    the rows shuffled (a group need not be contiguous)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, mask = [], []
    for i, length in enumerate(prompt_lengths):
        prompt = torch.randint(3, vocab, (length,), generator=gen)
        for _ in range(group_size):
            completion = torch.randint(3, vocab, (width,), generator=gen)
            kept = int(torch.randint(1, (longest[i] if longest else width) + 1, (1,), generator=gen))
            ids.append(torch.cat([torch.zeros(P - length, dtype=torch.long), prompt, completion]))
            mask.append(torch.cat([torch.zeros(P - length, dtype=torch.long), torch.ones(length, dtype=torch.long),
                                   (torch.arange(width) < kept).long()]))
    order = torch.randperm(len(ids), generator=gen)
    return torch.stack(ids)[order], torch.stack(mask)[order]


def _pass(model, ids, mask, share, micro_batches=1):
    """Per-token log-probs and entropies of every row, the LoRA gradients of a masked log-prob sum accumulated
    over `micro_batches` consecutive slices (gradient accumulation: a group may straddle two), and the token
    positions forwarded."""
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    from lowmem_grpo.train.cpu_logprobs import completion_logits

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


def _kept(mask, width=C):
    """The completion columns up to the last one any row of `mask` attends to."""
    return int(mask[:, -width:].any(dim=0).nonzero().max()) + 1


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
    from lowmem_grpo.train.cpu_logprobs import completion_logits, prompt_groups

    model = models["llama"]
    ids, mask = _batch([14, 9, 5], 1, model.config.vocab_size, seed=3)
    assert prompt_groups(ids, mask, P) is None
    out = completion_logits(model, ids, mask, C, share=True)
    assert not out.shared and out.tokens_forwarded == ids.numel()


def test_prompt_groups_compare_ids_and_mask_and_number_by_first_appearance():
    import torch

    from lowmem_grpo.train.cpu_logprobs import prompt_groups

    ids = torch.tensor([[0, 5, 6, 1], [0, 5, 6, 2], [7, 5, 6, 3], [0, 5, 6, 4], [7, 5, 6, 5]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    first, inverse = prompt_groups(ids, mask, 3)
    # rows 0/1 share ids and mask; row 3 has row 0's ids but another mask; rows 2/4 share
    assert first.tolist() == [0, 2, 3] and inverse.tolist() == [0, 0, 1, 2, 1]


def test_where_it_does_not_apply(models):
    from transformers import Qwen2Config

    from lowmem_grpo.train.cpu_logprobs import checkpointing_active, unsupported

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

    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer

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
        trainer.options = CpuPaths(shared_prompt=share)
        trainer._metrics["train"].clear()
        trainer.model.zero_grad()
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, batch_size=batch_size, compute_entropy=True)
        (logps * mask[:, -C:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results[share] = (logps.detach(), entropies.detach(), grads,
                          trainer._metrics["train"].get("shared_prompt/tokens_saved"))
    trainer.options = CpuPaths(shared_prompt=True)
    _assert_equal_passes(results[False], results[True], mask)
    saved = results[True][3]
    assert saved is not None and 0.0 < saved[0] < 1.0
    assert results[False][3][0] < saved[0]  # off: only the padding is skipped
    rows = ids.size(0)
    if batch_size is None:  # one chunk of 16 rows, 4 prompts
        assert saved[0] == pytest.approx(1 - (4 * P + rows * _kept(mask)) / (rows * (P + C)))
    # the temperature divides the logits (TRL's definition): at T=1 the log-probs differ
    trainer.temperature = 1.0
    try:
        with torch.no_grad():
            plain, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    finally:
        trainer.temperature = 0.7
    assert (plain - results[True][0]).abs().max() > 1e-3


def _untrimmed(model, ids, mask, temperature, width=C):
    """Log-probs and entropies of logits / T over every completion column, all rows in one full-row pass."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    from lowmem_grpo.train.cpu_logprobs import completion_logits

    scaled = completion_logits(model, ids, mask, width, share=False).logits.float() / temperature
    return selective_log_softmax(scaled, ids[:, -width:]), entropy_from_logits(scaled.detach())


def _trainer_pass(trainer, ids, mask, batch_size, share, width=C):
    """The trainer's pass (with entropies), and the token positions it forwarded (from its logged share)."""
    trainer.options = CpuPaths(shared_prompt=share)
    trainer._metrics["train"].clear()
    try:
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, width, batch_size=batch_size, compute_entropy=True)
    finally:
        trainer.options = CpuPaths(shared_prompt=True)
    saved = trainer._metrics["train"]["shared_prompt/tokens_saved"]
    assert len(saved) == 1
    return logps, entropies, round(ids.numel() * (1 - saved[0]))


def _distinct_prompts(ids, mask):
    import torch

    return torch.unique(torch.cat([ids[:, :P], mask[:, :P]], dim=1), dim=0).size(0)


# completions of prompt i at most LONGEST[i] tokens: every completion column past the longest is padding
PROMPTS, LONGEST = [14, 6, 10, 12], [3, 6, 5, 7]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_loss_pass_skips_padding_columns_exactly(trainer, share, batch_size):
    import torch

    ids, mask = _batch(PROMPTS, 4, trainer.model.config.vocab_size, seed=21, longest=LONGEST)
    real = mask[:, -C:].bool()
    results = []
    for ours in (False, True):
        trainer.model.zero_grad()
        if ours:
            logps, entropies, forwarded = _trainer_pass(trainer, ids, mask, batch_size, share)
        else:
            logps, entropies = _untrimmed(trainer.model, ids, mask, trainer.temperature)
        (logps * mask[:, -C:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results.append((logps.detach(), entropies.detach(), grads))
    _assert_equal_passes(results[0], results[1], mask)
    assert results[1][0].shape == results[1][1].shape == (ids.size(0), C)
    # TRL's micro-batches in order, each forwarded up to its own longest completion
    expected = 0
    for rows in torch.arange(ids.size(0)).split(batch_size or ids.size(0)):
        kept, prompts = _kept(mask[rows]), _distinct_prompts(ids[rows], mask[rows])
        shared = share and prompts < rows.numel()
        expected += (prompts * P + rows.numel() * kept) if shared else rows.numel() * (P + kept)
        # the columns not run hold 0, and every one is padding
        assert not real[rows, kept:].any() and (results[1][0][rows, kept:] == 0).all()
        assert (results[1][1][rows, kept:] == 0).all()
    assert _kept(mask) < C and forwarded == expected


@pytest.mark.parametrize("share", [True, False])
def test_pass_without_gradients_groups_rows_to_skip_padding(trainer, share):
    import torch

    from lowmem_grpo.train.cpu_logprobs import row_chunks

    width = 120  # one prompt's completions run up to 120 tokens, the others' up to a few: two forwards pay
    ids, mask = _batch(PROMPTS, 4, trainer.model.config.vocab_size, seed=22, longest=[3, 120, 5, 7], width=width)
    with torch.no_grad():
        full_logps, full_entropies = _untrimmed(trainer.model, ids, mask, trainer.temperature, width)
        logps, entropies, forwarded = _trainer_pass(trainer, ids, mask, 8, share, width)
        chunks = row_chunks(ids, mask, width, 8, share)
    real = mask[:, -width:].bool()
    assert (logps - full_logps)[real].abs().max().item() <= 1e-5  # in the caller's row order
    assert (entropies - full_entropies)[real].abs().max().item() <= 1e-5
    assert len(chunks) > 1 and sorted(torch.cat(chunks).tolist()) == list(range(ids.size(0)))
    if share:  # the long prompt's rows apart: each prompt forwarded once, each chunk up to its longest
        group = torch.unique(ids[:, :P], dim=0, return_inverse=True)[1]
        long = group == group[mask[:, -width:].sum(1).argmax()]
        expected = len(PROMPTS) * P + 4 * _kept(mask[long], width) + 12 * _kept(mask[~long], width)
        assert sorted(len(c) for c in chunks) == [4, 12]
    else:
        expected = sum(len(c) * (P + _kept(mask[c], width)) for c in chunks)
    assert forwarded == expected
    assert forwarded < (len(PROMPTS) * P + ids.size(0) * width if share else ids.numel())  # one forward, as before


def _shaped_batch(longest, prompt_width=83, group_size=8, width=64):
    """Ids and mask of the CPU default's shape (no model): prompt g's tokens all g + 3; its completions of
    lengths from longest[g] down, right-padded to `width`."""
    import torch

    rows = [(g, max(1, top - r)) for g, top in enumerate(longest) for r in range(group_size)]
    ids = torch.stack([torch.full((prompt_width + width,), g + 3) for g, _ in rows])
    mask = torch.stack([torch.cat([torch.ones(prompt_width, dtype=torch.long),
                                   (torch.arange(width) < n).long()]) for _, n in rows])
    return ids, mask


def test_row_chunks_group_rows_by_what_they_save():
    import torch

    from lowmem_grpo.train.cpu_logprobs import row_chunks

    ids, mask = _shaped_batch([36, 33, 34, 29])
    # with gradients: TRL's slices, in order
    assert [c.tolist() for c in row_chunks(ids, mask, 64, 8, True)] == [list(range(i, i + 8)) for i in (0, 8, 16, 24)]
    with torch.no_grad():
        # completions of similar lengths: one forward pays more than the padding it would skip
        assert [sorted(c.tolist()) for c in row_chunks(ids, mask, 64, 8, True)] == [list(range(32))]
        # one completion ran to the budget: its prompt's rows apart
        ids, mask = _shaped_batch([36, 64, 34, 29])
        chunks = row_chunks(ids, mask, 64, 8, True)
        assert sorted(sorted(c.tolist()) for c in chunks) == [[*range(8), *range(16, 32)], list(range(8, 16))]
        # without a fixed cost each chunk holds rows of one length (none is padded)
        for chunk in row_chunks(ids, mask, 64, 8, False, forward_cost=0):
            assert mask[chunk, 83:].sum(1).unique().numel() == 1


def test_fully_masked_completions_keep_one_column_and_a_graph(trainer):
    ids, mask = _batch([14, 9], 2, trainer.model.config.vocab_size, seed=5)
    mask[:, -C:] = 0  # TRL's mask_truncated_completions: truncated rows attend to none of their completion
    logps, entropies, forwarded = _trainer_pass(trainer, ids, mask, None, True)
    assert logps.shape == (4, C) and logps.requires_grad and (logps[:, 1:] == 0).all()
    assert forwarded == 2 * P + 4 * 1


def test_trainer_status_names_the_reason(trainer):
    assert trainer.shared_prompt_status()[0] is True
    trainer.options = CpuPaths(shared_prompt=False)
    try:
        assert trainer.shared_prompt_status() == (False, "not among the run's CPU speed paths: train.cpu.fast=false")
    finally:
        trainer.options = CpuPaths(shared_prompt=True)


# ---- a GRPO run --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_with_shared_prompt_equals_run_without(tiny_model_dir, tmp_path):
    # float32; 1.5 groups per micro-batch (TRL shuffles the rows), accumulation 2, generation every 4 micro-batches
    # (so TRL runs the old log-prob pass too) and beta > 0 (the reference pass)
    settings = ["model.dtype=float32", "prime.enabled=false", "train.preflight.enabled=false", "train.max_steps=3",
                "train.num_generations=4", "train.per_device_train_batch_size=6",
                "train.gradient_accumulation_steps=2", "train.steps_per_generation=4", "train.beta=0.04",
                "train.save_steps=10", "train.completions_every=0"]
    runs = {}
    for share in (True, False):  # the shared prompts alone: the other CPU paths stay on
        run_dir, logs = train_tiny(tiny_model_dir, tmp_path / f"run-{share}", *settings,
                                   cpu=CpuPaths(shared_prompt=share))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[share] = ([r for r in records if r.get("stage") == "grpo" and "loss" in r], logs.messages(logging.INFO))
    on, off = runs[True][0], runs[False][0]
    assert [r["step"] for r in on] == [r["step"] for r in off] == [1, 2, 3]
    for a, b in zip(on, off):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["kl"] - b["kl"]) <= 1e-5
        assert a["shared_prompt/tokens_saved"] > 0.2  # it really ran: a share of the prompt tokens was not run
        assert b["shared_prompt/tokens_saved"] < a["shared_prompt/tokens_saved"]  # off: only the padding is skipped
    assert any(m.startswith("shared-prompt log-prob pass: on") for m in runs[True][1])
    assert "shared-prompt log-prob pass: off (not among the run's CPU speed paths: train.cpu.fast=false)" \
        in runs[False][1]
