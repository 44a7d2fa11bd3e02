"""Faster sampling on CPU (lowmem_grpo.sampling.generate): the LoRA adapter merged into the weights
(merged_adapter, a CPU path of train.cpu.fast) computes the same function and the same greedy text as PEFT's unmerged
layers with the base weights never written, and a training run with it on equals one with it off; grouped-query
attention without copying the key/value heads (cpu_attention in float32) is bit-identical. Float32 on the tiny model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import TrainerCallback

from lowmem_grpo.runtime import CpuPaths
from resilience_helpers import CPU_RECIPE, Captured, one_torch_thread  # noqa: F401
from tiny_run import TINY_OVERRIDES

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(model_dir: Path, dropout: float = 0.0):
    """The tiny model in float32 with a LoRA adapter whose B is random (not PEFT's zeros), so it moves outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=TARGETS, task_type="CAUSAL_LM",
                        init_lora_weights=False)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model, AutoTokenizer.from_pretrained(model_dir)


def _prompts(tokenizer) -> list[str]:
    questions = ["Tom has 3 apples and buys 4 more. How many?", "What is 12 minus 5?", "Add 7 and 9.",
                 "A box holds 6 eggs; how many in 2 boxes?"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def _lora_layers(model):
    from peft.tuners.lora import Linear as LoraLinear

    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def test_merged_model_computes_the_adapter_models_logits_and_puts_every_module_back(tiny_model_dir):
    import torch

    from lowmem_grpo.sampling.generate import merged_adapter

    model, tokenizer = _lora_model(tiny_model_dir)
    model.eval()
    batch = tokenizer(_prompts(tokenizer), return_tensors="pt", padding=True)
    layers = _lora_layers(model)
    weights = {id(m): (m.base_layer.weight, m.base_layer.weight.detach().clone()) for m in layers}
    with torch.no_grad():
        unmerged = model(**batch).logits
        with model.disable_adapter():
            base = model(**batch).logits
        with merged_adapter(model) as result:
            assert result.layers == len(layers) == 2 * len(TARGETS)
            assert not _lora_layers(model)  # swapped for plain Linears: the adapter is not run on the side
            merged = model(**batch).logits
    assert (unmerged - base).abs().max() > 1e-2  # the adapter matters, so equal logits say it was merged in
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert _lora_layers(model) == layers  # the very modules are back
    for m in layers:
        param, before = weights[id(m)]
        assert m.base_layer.weight is param and torch.equal(param, before)  # never written
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, unmerged)


def test_greedy_text_is_the_same_merged_or_not(tiny_model_dir):
    from lowmem_grpo.sampling.generate import generate

    model, tokenizer = _lora_model(tiny_model_dir)
    prompts = _prompts(tokenizer)
    kwargs = dict(max_new_tokens=24, batch_size=4, progress=False, engine="transformers")
    unmerged = [g[0].text for g in generate(model, tokenizer, prompts, merged=False, **kwargs)]
    merged = [g[0].text for g in generate(model, tokenizer, prompts, merged=True, **kwargs)]
    with model.disable_adapter():
        base = [g[0].text for g in generate(model, tokenizer, prompts, **kwargs)]
    assert merged == unmerged
    assert base != unmerged  # the adapter changes the greedy text, so the comparison above sees it
    sampled = [generate(model, tokenizer, prompts, num_samples=2, temperature=1.0, seed=3, merged=m, **kwargs)
               for m in (False, True)]
    assert [[g.text for g in s] for s in sampled[0]] == [[g.text for g in s] for s in sampled[1]]


def test_it_stays_off_where_a_merged_weight_would_not_compute_the_same(tiny_model_dir):
    import torch

    from lowmem_grpo.sampling.generate import merged_adapter

    model, _ = _lora_model(tiny_model_dir, dropout=0.1)
    model.train()  # TRL samples in training mode: the adapter's dropout is live
    with merged_adapter(model) as result:
        assert result.layers == 0 and "dropout" in result.reason
        assert len(_lora_layers(model)) == 2 * len(TARGETS)
    model.eval()  # evaluation samples in eval mode, where dropout is the identity
    with merged_adapter(model) as result:
        assert result.layers == 2 * len(TARGETS)
    with model.disable_adapter(), merged_adapter(model) as result:  # stage eval's base model
        assert result.layers == 0 and "disabled" in result.reason
    with merged_adapter(model, enabled=False) as result:
        assert result.layers == 0 and result.reason == "off"
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with merged_adapter(plain) as result:
        assert result.layers == 0


def test_cpu_attention_in_float32_gives_bit_identical_logits_and_text_and_switches_back(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_grpo.sampling.attention import CPU_ATTENTION, cpu_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads to share
    batch = tokenizer(_prompts(tokenizer), return_tensors="pt", padding=True, padding_side="left")
    assert not bool(batch["attention_mask"].all())  # padded: the case where transformers copies the heads out
    with torch.no_grad():
        plain = model(**batch).logits
        plain_text = model.generate(**batch, max_new_tokens=24, do_sample=False)
        with cpu_attention(model) as switched:
            assert switched and model.config._attn_implementation == CPU_ATTENTION
            grouped = model(**batch).logits
            grouped_text = model.generate(**batch, max_new_tokens=24, do_sample=False)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(grouped, plain) and torch.equal(grouped_text, plain_text)
    with cpu_attention(model, enabled=False) as switched:
        assert not switched and model.config._attn_implementation == "sdpa"


class BaseWeightGuard(TrainerCallback):
    """Keeps a copy of every weight when training begins and finds, when it ends, the frozen ones that differ bit
    for bit from their copy or are no longer the same tensor, and whether the adapter moved."""

    def __init__(self) -> None:
        self.before: dict = {}
        self.changed: list[str] | None = None
        self.adapter_moved = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import torch

        now = dict(model.named_parameters())
        self.changed = [n for n, (p, copy) in self.before.items()
                        if not p.requires_grad and (now[n] is not p or not torch.equal(p, copy))]
        self.adapter_moved = any(p.requires_grad and not torch.equal(p, copy) for p, copy in self.before.values())


def _run(model_dir: Path, run_dir: Path, merged: bool):
    """10 GRPO steps of the CPU recipe on the tiny model in float32, stage and periodic evals on; returns the run
    dir, the guard and the log."""
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = load_recipe(CPU_RECIPE, [
        f"model.name={model_dir}", "model.backend=hf", "model.dtype=float32", f"output.dir={run_dir}",
        "prime.enabled=false", "train.preflight.enabled=false", "train.max_steps=10", "train.max_completion_length=16",
        "train.num_generations=4", "train.per_device_train_batch_size=8", "train.save_steps=100",
        "train.completions_every=1", "train.eval.stage.problems=4", "train.eval.every=5", "train.eval.problems=4",
        "train.learning_rate=5e-3", "train.temperature=1.0", *TINY_OVERRIDES])
    guard = BaseWeightGuard()
    captured = Captured()
    logger = logging.getLogger("lowmem_grpo")
    old = logger.level
    logger.addHandler(captured)
    logger.setLevel(logging.INFO)
    try:
        return train(recipe, callbacks=[guard], cpu=CpuPaths(merged=merged)), guard, captured.text  # merged alone
    finally:
        logger.removeHandler(captured)
        logger.setLevel(old)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_run_with_merged_sampling_equals_one_without_and_never_moves_the_base_weights(tiny_model_dir, tmp_path):
    on, guard_on, log_on = _run(tiny_model_dir, tmp_path / "on", merged=True)
    off, guard_off, log_off = _run(tiny_model_dir, tmp_path / "off", merged=False)
    assert "sampling from merged LoRA weights (14 layers" in log_on
    assert log_on.count("sampling from merged LoRA weights") == 1  # once per run, not per step
    assert "sampling through the unmerged LoRA adapter: off" in log_off

    for guard in (guard_on, guard_off):
        assert guard.before and guard.changed == [] and guard.adapter_moved
    steps_on = [m for m in _lines(on / "metrics.jsonl") if m.get("stage") == "grpo" and "loss" in m]
    steps_off = [m for m in _lines(off / "metrics.jsonl") if m.get("stage") == "grpo" and "loss" in m]
    assert len(steps_on) == len(steps_off) == 10
    assert any(abs(m["loss"]) > 1e-6 for m in steps_on)  # a run that trains, not ten zero losses
    for a, b in zip(steps_on, steps_off):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)
    texts_on = [(g["step"], c["text"]) for g in _lines(on / "completions.jsonl") for c in g["completions"]]
    texts_off = [(g["step"], c["text"]) for g in _lines(off / "completions.jsonl") for c in g["completions"]]
    assert len(texts_on) == 10 * 8 and texts_on == texts_off
    evals_on = [m for m in _lines(on / "metrics.jsonl") if m.get("stage") == "eval"]
    evals_off = [m for m in _lines(off / "metrics.jsonl") if m.get("stage") == "eval"]
    assert len(evals_on) == 2 and [m["eval/reward"] for m in evals_on] == [m["eval/reward"] for m in evals_off]
    stages_on = json.loads((on / "stage_eval.json").read_text())["verdicts"]
    assert stages_on == json.loads((off / "stage_eval.json").read_text())["verdicts"]
