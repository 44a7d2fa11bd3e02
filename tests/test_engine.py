"""The sampling engine (lowmem_grpo.sampling.engine) and GRPO's rollouts through it (lowmem_grpo.sampling.rollout).

Tiny float32 models from tests/tiny.py for exactness against transformers' generate, and a scripted model (a
small module that writes a fixed token script per prompt) for the calculator, whose forcing must land on exact
token positions.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from lowmem_grpo.sampling.engine import COMPACT_SHARE, Calculator, Sampled, next_tokens, sample_rows
from lowmem_grpo.sampling.generate import fast_sampling, generate
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.sampling.rollout import EngineRollout

CPU_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m_gsm8k_cpu.py"
PROMPTS = ["Natalia sold clips to 48 of her friends", "How many", "A robe takes 2 bolts",
           "<|im_start|>user\nHow many apples?<|im_end|>\n<|im_start|>assistant\n",
           "Weng earns $12 an hour for babysitting. Yesterday", "Betty is saving", "Julie is reading a 120-page book.",
           "James writes"]
"""Prompts of different lengths; the fourth holds the EOS token (<|im_end|>) inside it, as chat prompts do."""


# --- fixtures ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


def _load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class BatchSizes:
    """A forward pre-hook recording each forward call's (rows, tokens per row)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, int]] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append(tuple(ids.shape))

    def remove(self) -> None:
        self.handle.remove()


def _reference(model, tokenizer, prompts: list[str], max_new_tokens: int, eos: int) -> list[Sampled]:
    """transformers' greedy generate, left padded, cut at the first EOS (kept), as Sampled rows."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
    rows = []
    for new in out[:, batch["input_ids"].shape[1]:].tolist():
        if eos in new:
            new = new[:new.index(eos) + 1]
            rows.append(Sampled(new, [0] * len(new), truncated=False))
        else:
            rows.append(Sampled(new, [0] * len(new), truncated=True))
    return rows


def _ending_model(model_dir: Path, tokenizer, max_new_tokens: int):
    """The tiny model with its EOS output row scaled up until greedy generate ends enough rows of PROMPTS early to
    be dropped from the batch, at different steps, while another runs to max_new_tokens (a random model alone
    never writes an EOS). Tied embeddings scale the EOS input row too, which only an ended row's placeholder
    ever reads."""
    eos = tokenizer.eos_token_id
    for scale in (5.0, 5.5, 6.0, 7.0, 8.0, 10.0, 12.0):
        model = _load(model_dir)
        with torch.no_grad():
            model.get_output_embeddings().weight[eos] *= scale
        ref = _reference(model, tokenizer, PROMPTS, max_new_tokens, eos)
        ends = [len(r.ids) for r in ref if not r.truncated]
        # enough ended rows to be dropped from the batch (COMPACT_SHARE), at different steps, and one left writing
        if len(set(ends)) >= 2 and len(ends) >= math.ceil(COMPACT_SHARE * len(ref)) and len(ends) < len(ref):
            return model, ref
    raise AssertionError("no EOS scale ends rows at different steps: the test lost its early-ending rows")


# --- 1. exactness -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast_sampling"])
def test_greedy_rows_equal_transformers_generate(arch, fast, tiny_model_dir, qwen2_dir, tokenizer):
    model_dir = tiny_model_dir if arch == "llama" else qwen2_dir
    max_new = 16
    model, ref = _ending_model(model_dir, tokenizer, max_new)
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    assert len({len(p) for p in prompt_ids}) > 3  # different lengths: real left padding
    sizes = BatchSizes(model)
    with fast_sampling(model, attention=fast, merged=fast):
        rows = sample_rows(model, prompt_ids, max_new_tokens=max_new, temperature=0.0,
                           eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id)
    sizes.remove()
    assert [r.ids for r in rows] == [r.ids for r in ref]
    assert [r.truncated for r in rows] == [r.truncated for r in ref]
    assert all(r.forced == [0] * len(r.ids) for r in rows)
    # the ended rows were dropped from the batch (engine.COMPACT_SHARE) and the result is still generate's
    decode_rows = [rows_ for rows_, width in sizes.calls[1:]]
    assert sizes.calls[0][0] == len(PROMPTS) and decode_rows[0] == len(PROMPTS)
    assert min(decode_rows) < len(PROMPTS), decode_rows
    assert decode_rows == sorted(decode_rows, reverse=True)
    assert len(sizes.calls) == max(len(r.ids) for r in rows)  # no decode step after the last token


# --- 2. sampling ------------------------------------------------------------------------------------------------

def test_next_tokens_draws_softmax_frequencies_and_argmax_at_zero():
    logits = torch.tensor([[0.0, 1.0, 2.5]])
    draws = 40_000
    for temperature in (1.0, 0.5, 2.0):
        generator = torch.Generator().manual_seed(1)
        tokens = next_tokens(logits.expand(draws, 3).clone(), temperature, generator)
        counts = torch.bincount(tokens, minlength=3).double()
        expected = torch.softmax(logits[0].double() / temperature, dim=-1) * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 13.8, (temperature, counts.tolist(), expected.tolist())  # chi-square, 2 dof, p = 0.001
    # a broken draw (uniform, or always the argmax) is far outside that tolerance
    uniform = torch.full((3,), draws / 3)
    expected = torch.softmax(logits[0].double(), dim=-1) * draws
    assert float(((uniform - expected) ** 2 / expected).sum()) > 1000
    greedy = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9], [-2.0, -3.0, -1.0]])
    assert next_tokens(greedy, 0.0).tolist() == [1, 0, 2]
    # very peaked logits never produce an out-of-range index
    peaked = torch.tensor([[-1e4, 1e4, -1e4]]).expand(1000, 3).clone()
    assert set(next_tokens(peaked, 1.0, torch.Generator().manual_seed(0)).tolist()) == {1}


def test_seeded_sampling_repeats_and_another_seed_differs(tiny_model_dir, tokenizer):
    model = _load(tiny_model_dir)
    prompt_ids = tokenizer(PROMPTS[:4])["input_ids"]

    def draw(seed: int) -> list[list[int]]:
        rows = sample_rows(model, prompt_ids, max_new_tokens=10, temperature=1.0,
                           eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                           generator=torch.Generator().manual_seed(seed))
        return [r.ids for r in rows]

    first = draw(3)
    assert draw(3) == first
    assert draw(4) != first
    greedy = sample_rows(model, prompt_ids, max_new_tokens=10, temperature=0.0, eos_ids={tokenizer.eos_token_id},
                         pad_id=tokenizer.pad_token_id)
    assert [r.ids for r in greedy] != first  # T 1 over a random model's flat logits is not its argmax


# --- 3. prompt sharing ------------------------------------------------------------------------------------------

def test_rows_repeating_a_prompt_share_one_prefill(tiny_model_dir, tokenizer):
    model = _load(tiny_model_dir)
    a, b = tokenizer(["Natalia sold clips to 48", "How many"])["input_ids"]
    settings = dict(max_new_tokens=8, temperature=0.0, eos_ids={tokenizer.eos_token_id},
                    pad_id=tokenizer.pad_token_id)
    alone = {name: sample_rows(model, [ids], **settings)[0].ids for name, ids in (("a", a), ("b", b))}
    sizes = BatchSizes(model)
    rows = sample_rows(model, [b, a, a, b, a], **settings)  # reordered and repeated
    sizes.remove()
    assert [r.ids for r in rows] == [alone["b"], alone["a"], alone["a"], alone["b"], alone["a"]]
    prefill, *decode = sizes.calls
    assert prefill == (2, max(len(a), len(b)))  # each distinct prompt forwarded once
    assert all(call == (5, 1) for call in decode)  # then one token per row, every row


# --- 4. calculator forcing --------------------------------------------------------------------------------------

class ScriptedLM(torch.nn.Module):
    """Writes a fixed token script per prompt whatever it is fed: at completion step t the logit of script[t] is
    far above the rest (EOS past the script's end). Which script a batch row follows, and where its completion
    starts, ride in its (one-layer, one-head) KV cache, so the engine's cache copies and row drops carry them as
    they carry a real model's state."""

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], vocab_size: int, eos: int) -> None:
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the engine reads the device off the parameters
        self.prompts = list(scripts)
        self.scripts = list(scripts.values())
        self.eos = eos

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache=True, logits_to_keep=0,
                **kwargs):
        rows, width = input_ids.shape
        if past_key_values.get_seq_length() == 0:
            tags = torch.tensor([[self.prompts.index(tuple(ids[m.bool()].tolist())), int(m.sum())]
                                 for ids, m in zip(input_ids, attention_mask)], dtype=torch.float32)
            keys = tags[:, None, None, :].expand(rows, 1, width, 2).contiguous()
        else:
            keys = past_key_values.layers[0].keys[:, :, :1, :].clone()
        past_key_values.update(keys, keys, 0)
        tags = past_key_values.layers[0].keys[:, 0, 0, :].long()
        steps = position_ids[:, -1] - tags[:, 1] + 1  # the completion step the next token is written at
        logits = torch.zeros(rows, 1, self.config.vocab_size)
        for row, (script, step) in enumerate(zip(tags[:, 0].tolist(), steps.tolist())):
            written = self.scripts[script]
            logits[row, 0, written[step] if step < len(written) else self.eos] = 100.0
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)  # as transformers returns it


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    """(model, prompts, expected): prompt text -> what the row must hold with the calculator."""
    enc = lambda text: _enc(tokenizer, text)  # noqa: E731
    eos = tokenizer.eos_token_id
    result = enc("7>>")
    assert len(result) >= 2  # forcing spans decode steps
    placeholder = enc("9") * len(result)  # what the policy would write where the calculator forces
    calls = enc("<<12-5=") + placeholder + enc(" apples") + [eos]
    plain = enc("12-5=7 apples") + [eos]  # an "=" without an open "<<": nothing to force
    refused = enc("<<12/0=") + enc("x>> done") + [eos]  # does not evaluate: nothing forced
    prompts = {"Q: calls": calls, "Q: plain": plain, "Q: refused": refused}
    scripts = {tuple(enc(p)): s for p, s in prompts.items()}
    model = ScriptedLM(scripts, len(tokenizer), eos)
    expected = {
        "Q: calls": (enc("<<12-5=") + result + enc(" apples") + [eos],
                     [0] * len(enc("<<12-5=")) + [1] * len(result) + [0] * (len(enc(" apples")) + 1)),
        "Q: plain": (plain, [0] * len(plain)),
        "Q: refused": (refused, [0] * len(refused)),
    }
    return model, list(prompts), expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_calculator_forces_its_result_per_row(scripted, tokenizer, temperature):
    model, prompts, expected = scripted
    order = [prompts[1], prompts[0], prompts[2], prompts[0]]  # a calling row among rows that do not call
    rows = sample_rows(model, [_enc(tokenizer, p) for p in order], max_new_tokens=30, temperature=temperature,
                       eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                       calculator=Calculator(tokenizer), generator=torch.Generator().manual_seed(0))
    for prompt, row in zip(order, rows):
        ids, forced = expected[prompt]
        assert row.ids == ids, (prompt, tokenizer.decode(row.ids))
        assert row.forced == forced, prompt
        assert row.policy_mask == [1 - f for f in forced]
        assert not row.truncated  # forcing stops at EOS as usual: the policy's EOS after it ends the row
    assert "<<12-5=7>> apples" in tokenizer.decode(rows[1].ids)
    # without the calculator the same policy writes its own digits where the calculator wrote 7>>
    plain = sample_rows(model, [_enc(tokenizer, prompts[0])], max_new_tokens=30, temperature=temperature,
                        eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id)[0]
    assert tokenizer.decode(plain.ids, skip_special_tokens=True) == "<<12-5=99 apples"
    assert plain.forced == [0] * len(plain.ids)


def test_running_out_of_tokens_inside_forced_tokens_is_truncated(scripted, tokenizer):
    model, prompts, expected = scripted
    ids, forced = expected[prompts[0]]
    cut = len(_enc(tokenizer, "<<12-5=")) + 1  # the budget ends after the first forced token
    row = sample_rows(model, [_enc(tokenizer, prompts[0])], max_new_tokens=cut, temperature=0.0,
                      eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                      calculator=Calculator(tokenizer))[0]
    assert row.ids == ids[:cut] and row.forced == forced[:cut] and row.forced[-1] == 1
    assert row.truncated


def test_generate_with_the_calculator_writes_and_counts_forced_tokens(scripted, tokenizer):
    model, prompts, _ = scripted
    on = generate(model, tokenizer, prompts, max_new_tokens=30, progress=False, calculator=True)
    off = generate(model, tokenizer, prompts, max_new_tokens=30, progress=False)
    calls, plain, refused = (samples[0] for samples in on)
    assert calls.text == "<<12-5=7>> apples" and calls.forced_tokens == len(_enc(tokenizer, "7>>"))
    assert not calls.truncated and calls.tokens == len(_enc(tokenizer, "<<12-5=7>> apples")) + 1  # EOS counted
    assert plain.text == "12-5=7 apples" and plain.forced_tokens == 0
    assert refused.text == "<<12/0=x>> done" and refused.forced_tokens == 0
    assert off[0][0].text == "<<12-5=99 apples" and off[0][0].forced_tokens == 0


# --- 5. rollouts ------------------------------------------------------------------------------------------------

class FakeAccelerator:
    def unwrap_model(self, model):
        return model


def _fake_trainer(model, tokenizer, max_completion_length: int = 30):
    """The attributes of TRL's GRPOTrainer that EngineRollout reads."""
    return SimpleNamespace(processing_class=tokenizer, accelerator=FakeAccelerator(), model=model,
                           eos_token_ids=[tokenizer.eos_token_id], max_completion_length=max_completion_length,
                           temperature=1.0)


def test_engine_rollout_returns_trls_keys_and_the_env_mask(scripted, tokenizer):
    model, prompts, expected = scripted
    repeated = [p for p in prompts for _ in range(2)]  # TRL's sampler repeats each prompt num_generations times
    model.train()
    out = EngineRollout(tokenizer, calculator=True)(repeated, _fake_trainer(model, tokenizer))
    assert model.training  # put back in the mode training left it in
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
    assert out["prompt_ids"] == tokenizer(text=repeated)["input_ids"]  # as TRL's own _tokenize_prompts gives them
    assert out["logprobs"] is None
    assert out["completion_ids"] == [expected[p][0] for p in repeated]
    assert out["env_mask"] == [[1 - f for f in expected[p][1]] for p in repeated]
    assert 0 in out["env_mask"][0] and all(1 in m for m in out["env_mask"])
    without = EngineRollout(tokenizer, calculator=False)(repeated, _fake_trainer(model, tokenizer))
    assert set(without) == {"prompt_ids", "completion_ids", "logprobs"}
    assert tokenizer.decode(without["completion_ids"][0], skip_special_tokens=True) == "<<12-5=99 apples"


def _recipe(*overrides: str):
    return load_recipe(str(CPU_RECIPE), list(overrides))


# (how GRPO samples, and what it refuses, is lowmem_grpo.combinations: tests/test_combinations.py)


# --- 6. what TRL does with rollout_func and env_mask ------------------------------------------------------------

def test_trl_takes_the_rollout_env_mask_out_of_the_loss():
    """Pins TRL 1.15's behaviour the engine's rollouts rely on (GRPOTrainer's private _generate and
    _generate_and_score_completions, read as source: the rollout_func seam is marked experimental)."""
    import trl
    from trl import GRPOTrainer

    assert trl.__version__.startswith("1.15"), f"re-check this pin for TRL {trl.__version__}"
    assert "rollout_func" in inspect.signature(GRPOTrainer.__init__).parameters
    generate_src = inspect.getsource(GRPOTrainer._generate)
    assert "self.rollout_func(prompts, self)" in generate_src
    assert 'required_keys = {"prompt_ids", "completion_ids", "logprobs"}' in generate_src
    assert 'tool_mask = extra_fields.pop("env_mask", None)' in generate_src
    score_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask" in score_src
    assert 'output["tool_mask"] = tool_mask' in score_src  # the mask reaches the loss's inputs
    # the policy loss and its KL term are masked by the same product in the loss itself
    loss_src = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in loss_src
    assert "per_token_loss = per_token_loss + self.beta * per_token_kl" in loss_src  # the KL added before the mask


# --- 7. a GRPO run with the calculator --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tiny_grpo_run_samples_through_the_engine_with_the_calculator(tiny_model_dir, tmp_path):
    from tiny_run import train_tiny

    run_dir, logs = train_tiny(tiny_model_dir, tmp_path / "run", "data.calculator=true", "train.max_steps=1",
                               "prime.enabled=false", "train.preflight.enabled=false", "train.eval.stage.problems=0",
                               "train.save_steps=10", "train.completions_every=0")
    messages = logs.messages(logging.INFO)
    assert any("GRPO sampling: lowmem_grpo's engine with the calculator" in m for m in messages), messages
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("stage") == "grpo" and "loss" in r]
    assert [r["step"] for r in steps] == [1] and math.isfinite(steps[0]["loss"])


# --- stage-evaluation progress ----------------------------------------------------------------------------------

class Calls:
    """An on_progress callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))


class Clock:
    """A clock that reads the given times in turn."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_generate_reports_progress_after_each_batch(tiny_model_dir, tokenizer):
    from lowmem_grpo.evaluation.evaluate import run_eval

    model = _load(tiny_model_dir)
    greedy = Calls()
    generate(model, tokenizer, PROMPTS[:5], max_new_tokens=3, batch_size=2, progress=False, on_progress=greedy)
    assert greedy.calls == [(2, 5), (4, 5), (5, 5)]
    sampled = Calls()  # a batch counts sequences: 4 of them are 2 problems' 2 samples
    generate(model, tokenizer, PROMPTS[:3], max_new_tokens=3, batch_size=4, num_samples=2, temperature=1.0,
             progress=False, on_progress=sampled)
    assert sampled.calls == [(2, 3), (3, 3)]
    examples = [{"prompt": p, "answer": "1", "prefill": ""} for p in PROMPTS[:3]]
    through_eval = Calls()
    run_eval(model, tokenizer, examples, max_new_tokens=3, batch_size=1, progress=False, on_progress=through_eval)
    assert through_eval.calls == [(1, 3), (2, 3), (3, 3)]


def test_progress_lines_give_done_rate_and_eta_at_most_every_interval(caplog):
    from lowmem_grpo.evaluation.progress import ProgressLog

    report = ProgressLog("stage eval base: greedy", every=10.0, clock=Clock(100.0, 105.0, 112.0, 115.0, 160.0))
    with caplog.at_level(logging.INFO, logger="lowmem_grpo.evaluation.progress"):
        for done in (10, 20, 30, 40):  # at 5 s, 12 s, 15 s and 60 s after it was made
            report(done, 40)
    assert [r.getMessage() for r in caplog.records] == [
        "stage eval base: greedy 20/40 problems | 100/min | eta 0m12s",  # 5 s in: too soon after the start
        "stage eval base: greedy 40/40 problems | 40/min | done in 1m00s",  # 15 s in: 3 s after the last line
    ]


def test_stage_evaluation_logs_its_progress(tiny_model_dir, tokenizer, tmp_path, caplog):
    from lowmem_grpo.evaluation.stages import StageEvals

    recipe = _recipe("train.eval.stage.problems=3", "train.eval.stage.samples=2", "train.max_completion_length=4",
                     "train.eval.stage.stages=[base]")
    evals = StageEvals(recipe, tokenizer, tmp_path / "stage_eval.json")
    with caplog.at_level(logging.INFO, logger="lowmem_grpo.evaluation.stages"):
        evals.measure(_load(tiny_model_dir), "base")
    lines = [r.getMessage() for r in caplog.records if r.name == "lowmem_grpo.evaluation.stages"]
    progress = [line for line in lines if " problems | " in line]
    assert len(progress) == 2, lines
    assert progress[0].startswith("stage eval base: greedy 3/3 problems | ") and "/min | done in " in progress[0]
    assert progress[1].startswith("stage eval base: 2 samples 3/3 problems | ")
    assert lines.index(progress[1]) < len(lines) - 1 and "strict accuracy" in lines[-1]  # before the summary


# --- preallocated KV cache --------------------------------------------------------------------------------------

def test_preallocated_layer_writes_in_place_grows_and_selects_rows():
    from lowmem_grpo.sampling.kv_cache import PreallocatedLayer

    layer = PreallocatedLayer(capacity=4)
    k, v = torch.randn(3, 2, 3, 5), torch.randn(3, 2, 3, 5)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and layer.get_seq_length() == 3
    buffer = layer.key_buffer
    step = torch.randn(3, 2, 1, 5)
    keys, _ = layer.update(step, step)
    assert layer.key_buffer is buffer  # written in place, no new block
    assert torch.equal(keys, torch.cat([k, step], dim=-2))
    keys, values = layer.update(step, step)  # past the capacity: the buffers grow, the contents stay
    assert layer.key_buffer.shape[-2] >= 6 and torch.equal(keys, torch.cat([k, step, step], dim=-2))
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, torch.cat([k, step, step], dim=-2)[[2, 0]])
    assert layer.get_seq_length() == 5 and layer.get_mask_sizes(1) == (6, 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_preallocated_cache_samples_what_dynamic_cache_samples(temperature, tiny_model_dir, tokenizer):
    """Greedy and seeded rows bit for bit the same with the preallocated cache as with transformers' DynamicCache,
    float32, with rows ending (the batch shrinks) and a row writing to the budget."""
    from lowmem_grpo.sampling.engine import DecodeContract

    model, _ = _ending_model(tiny_model_dir, tokenizer, 16)
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    runs = {}
    for preallocate in (False, True):
        rows = sample_rows(model, prompt_ids, max_new_tokens=16, temperature=temperature,
                           eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                           generator=torch.Generator().manual_seed(5), contract=DecodeContract(preallocate=preallocate))
        runs[preallocate] = [(r.ids, r.truncated) for r in rows]
    assert runs[True] == runs[False]
    if temperature == 0:  # greedy rows of _ending_model end at different steps: the batch shrank
        assert any(t for _, t in runs[True]) and not all(t for _, t in runs[True])
