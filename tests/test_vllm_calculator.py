"""The calculator on vLLM (lowmem_grpo.sampling.vllm_calculator), GRPO's rollouts through it
(lowmem_grpo.sampling.rollout.VllmRollout) and generate()'s vLLM branch with the calculator.

vllm is not installed here (it needs CUDA). The engine is a fake that keeps the contract of `vllm.LLM.generate`
(vllm/entrypoints/llm.py: TokensPrompt dicts in, one SamplingParams per prompt, a RequestOutput per prompt whose
CompletionOutputs carry token_ids, logprobs as one {token id: Logprob} dict per sampled token, finish_reason),
driven by a token script per prompt. It honours
n, max_tokens, stop_token_ids (the stop token is the output's last id), logprobs and the EOS, and records every
request and LoRA request it is given. It cannot confirm what vLLM itself does with stop_token_ids and logprobs=0:
that is read from vLLM's documentation, and none of this has run on a GPU. The SamplingParams stand-in is a
dataclass with vLLM's field names, so a field vLLM does not have fails here as a TypeError.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lowmem_grpo.runtime import rollout_plan
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.sampling.engine import Calculator
from lowmem_grpo.sampling.generate import LIVE_ADAPTER, generate
from lowmem_grpo.sampling.vllm_calculator import (
    EngineRounds,
    calculator_rows,
    row_seed,
)
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.sampling.rollout import EngineRollout, VllmRollout, make_rollout

CPU_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m_gsm8k_cpu.py"


# --- the fake vLLM ------------------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """vllm.SamplingParams' fields that the loop sets (vllm/sampling_params.py), with vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None


@dataclass
class Logprob:
    """vllm.logprobs.Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """The fields of vllm.outputs.CompletionOutput the loop reads."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def scripted_logprob(position: int) -> float:
    """The log-prob the fake gives the token it writes at completion position `position`."""
    return -(position + 1) / 1000


class ScriptedVllm:
    """A vllm.LLM whose samples follow a token script per prompt: a request continuing a prompt at completion
    position t writes script[t], script[t + 1], ... (EOS past the script's end) until a stop token (kept), the EOS
    or max_tokens. Forced tokens therefore take the place of the script's tokens at their positions, as they take
    a policy's. Records each call's token ids, SamplingParams and LoRA request, and sleep-mode calls in `events`."""

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], eos: int, shared_weights: bool = False) -> None:
        self.scripts = scripts
        self.eos = eos
        self.calls: list[dict[str, Any]] = []
        self.events: list[str] = []
        if shared_weights:
            self.shared_weights = True  # as Unsloth marks its fast_inference engine

    def write(self, token_ids: list[int], max_tokens: int, stops: set[int]) -> tuple[list[int], list[float], str]:
        prompt = max((p for p in self.scripts if tuple(token_ids[:len(p)]) == p), key=len)
        script = self.scripts[prompt]
        start = len(token_ids) - len(prompt)
        ids: list[int] = []
        while len(ids) < max_tokens:
            position = start + len(ids)
            ids.append(script[position] if position < len(script) else self.eos)
            if ids[-1] == self.eos or ids[-1] in stops:
                return ids, [scripted_logprob(start + i) for i in range(len(ids))], "stop"
        return ids, [scripted_logprob(start + i) for i in range(len(ids))], "length"

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.events.append("generate")
        self.calls.append({"token_ids": [list(p["prompt_token_ids"]) for p in prompts], "params": params,
                           "lora_request": lora_request})
        results = []
        for prompt, p in zip(prompts, params):
            outputs = []
            for _ in range(p.n):
                ids, logprobs, reason = self.write(list(prompt["prompt_token_ids"]), p.max_tokens,
                                                   set(p.stop_token_ids or ()))
                lps = None if p.logprobs is None else [{t: Logprob(lp, rank=1)} for t, lp in zip(ids, logprobs)]
                stop = ids[-1] if reason == "stop" and ids[-1] != self.eos else None
                outputs.append(CompletionOutput(ids, lps, reason, stop))
            results.append(RequestOutput(list(prompt["prompt_token_ids"]), outputs))
        return results

    def wake_up(self, tags=None):
        self.events.append(f"wake_up({','.join(tags or [])})")

    def sleep(self, level=1):
        self.events.append(f"sleep({level})")


@dataclass
class FakeGeneration:
    """The attributes of TRL's VLLMGeneration (trl/generation/vllm_generation.py) that VllmRollout reads."""

    llm: Any = None
    mode: str = "colocate"
    enable_sleep_mode: bool = False
    _llm_weights_sleeping: bool = False
    tensor_parallel_size: int = 1
    structured_outputs_regex: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict = field(default_factory=dict)

    def sync_weights(self):
        self.llm.events.append("sync_weights")
        self._llm_weights_sleeping = False


class UnslothLikeModel:
    """An adapter model with Unsloth's `load_lora` (unsloth_zoo/vllm_utils.py load_lora): records its calls."""

    peft_config = {"default": object()}

    def __init__(self) -> None:
        self.loads: list[tuple[str, bool]] = []

    def load_lora(self, name, load_tensors=False):
        self.loads.append((name, load_tensors))
        return ("lora request", name, len(self.loads))


class FakeAccelerator:
    is_main_process = True
    process_index = 0

    def unwrap_model(self, model):
        return model


def _rollout(tokenizer, **kwargs) -> VllmRollout:
    from lowmem_grpo.train.trainer import vllm_awake

    return VllmRollout(tokenizer, sampling_params_class=SamplingParams, awake=vllm_awake, **kwargs)


def _trainer(tokenizer, generation, model=None, max_completion_length: int = 30):
    """The attributes of TRL's GRPOTrainer that VllmRollout reads."""
    return SimpleNamespace(processing_class=tokenizer, accelerator=FakeAccelerator(), model=model or object(),
                           eos_token_ids=[tokenizer.eos_token_id], max_completion_length=max_completion_length,
                           use_vllm=True, vllm_generation=generation)


# --- fixtures -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    """(scripts by prompt text, expected rows): what each row must hold with the calculator, as token ids, forced
    flags and log-probs."""
    enc = lambda text: _enc(tokenizer, text)  # noqa: E731
    eos = tokenizer.eos_token_id
    result = enc("7>>")
    assert len(result) >= 2 and enc("<<12-5=")[-1] in Calculator(tokenizer).triggers
    placeholder = enc("9") * len(result)  # what the policy would write where the calculator forces
    scripts = {
        "Q: calls": enc("<<12-5=") + placeholder + enc(" apples") + [eos],
        "Q: plain": enc("12-5=7 apples") + [eos],  # an "=" without an open "<<": nothing to force
        "Q: refused": enc("<<12/0=") + enc("x>> done") + [eos],  # does not evaluate: nothing forced
    }
    calls = enc("<<12-5=") + result + enc(" apples") + [eos]
    forced = [0] * len(enc("<<12-5=")) + [1] * len(result) + [0] * (len(enc(" apples")) + 1)
    expected = {"Q: calls": (calls, forced)}
    for name in ("Q: plain", "Q: refused"):
        expected[name] = (scripts[name], [0] * len(scripts[name]))
    return scripts, expected


def _engine(tokenizer, scripts: dict[str, list[int]], **kwargs) -> ScriptedVllm:
    return ScriptedVllm({tuple(tokenizer(text=p)["input_ids"]): s for p, s in scripts.items()},
                        tokenizer.eos_token_id, **kwargs)


def _rows(engine, tokenizer, prompts, max_tokens=30, **kwargs):
    ids = tokenizer(text=prompts)["input_ids"]
    sample = EngineRounds(engine, {"temperature": 1.0}, params_class=SamplingParams)
    return calculator_rows(sample, ids, max_tokens=max_tokens, calculator=Calculator(tokenizer),
                           eos_ids={tokenizer.eos_token_id}, **kwargs)


# --- 1. the loop --------------------------------------------------------------------------------------------------

def test_forced_tokens_land_at_exact_positions_with_mask_and_logprob(scripted, tokenizer):
    scripts, expected = scripted
    engine = _engine(tokenizer, scripts)
    order = ["Q: plain", "Q: calls", "Q: refused", "Q: calls"]  # a calling row among rows that do not call
    rows = _rows(engine, tokenizer, order)
    for prompt, row in zip(order, rows):
        ids, forced = expected[prompt]
        assert row.ids == ids, (prompt, tokenizer.decode(row.ids))
        assert row.forced == forced and row.policy_mask == [1 - f for f in forced]
        # every sampled token carries the log-prob vLLM gave it at its position; forced ones None
        assert row.logprobs == [None if f else scripted_logprob(i) for i, f in enumerate(forced)]
        assert not row.truncated  # ended at the EOS, which is kept
    assert tokenizer.decode(rows[1].ids, skip_special_tokens=True) == "<<12-5=7>> apples"
    # every request: token ids (no text), n=1, logprobs=0, the triggers and the EOS as stops
    stops = sorted(Calculator(tokenizer).triggers | {tokenizer.eos_token_id})
    for call in engine.calls:
        for p in call["params"]:
            assert p.n == 1 and p.logprobs == 0 and p.stop_token_ids == stops and p.seed is None


def test_rows_are_resubmitted_as_token_ids_with_what_is_left_of_the_budget(scripted, tokenizer):
    scripts, expected = scripted
    engine = _engine(tokenizer, scripts)
    prompt = {name: tokenizer(text=name)["input_ids"] for name in scripts}
    _rows(engine, tokenizer, ["Q: calls", "Q: plain", "Q: refused"], max_tokens=30)
    first, second = engine.calls  # every row stops once, at its "="
    assert first["token_ids"] == [prompt["Q: calls"], prompt["Q: plain"], prompt["Q: refused"]]
    assert [p.max_tokens for p in first["params"]] == [30, 30, 30]
    so_far = {"Q: calls": _enc(tokenizer, "<<12-5=") + _enc(tokenizer, "7>>"),  # the forced result included
              "Q: plain": _enc(tokenizer, "12-5="),  # a bare "=": resubmitted unchanged, nothing forced
              "Q: refused": _enc(tokenizer, "<<12/0=")}  # does not evaluate: unchanged
    assert second["token_ids"] == [prompt[n] + so_far[n] for n in ("Q: calls", "Q: plain", "Q: refused")]
    assert [p.max_tokens for p in second["params"]] == [30 - len(so_far[n]) for n in ("Q: calls", "Q: plain",
                                                                                      "Q: refused")]


def test_the_budget_is_respected_exactly_and_cuts_forced_tokens(scripted, tokenizer):
    scripts, expected = scripted
    full, forced = expected["Q: calls"]
    for budget in range(1, len(full) + 2):
        engine = _engine(tokenizer, scripts)
        row = _rows(engine, tokenizer, ["Q: calls"], max_tokens=budget)[0]
        assert row.ids == full[:budget] and row.forced == forced[:budget], budget  # a prefix of the unbounded row
        assert row.truncated == (budget < len(full)), budget
        assert sum(len(c["token_ids"][0]) - len(tokenizer(text="Q: calls")["input_ids"]) + c["params"][0].max_tokens
                   == budget for c in engine.calls) == len(engine.calls)  # each round asks for what is left
    calls = len(_enc(tokenizer, "<<12-5="))
    at_trigger = _rows(_engine(tokenizer, scripts), tokenizer, ["Q: calls"], max_tokens=calls)[0]
    assert at_trigger.forced == [0] * calls and at_trigger.truncated  # the budget ends at "=": nothing forced
    inside = _rows(_engine(tokenizer, scripts), tokenizer, ["Q: calls"], max_tokens=calls + 1)[0]
    assert inside.forced[-1] == 1 and inside.logprobs[-1] is None and inside.truncated


def test_the_round_cap_ends_the_loop_and_the_last_round_samples_without_the_calculator(tokenizer):
    enc = lambda text: _enc(tokenizer, text)  # noqa: E731
    eos = tokenizer.eos_token_id
    three = enc("<<1+1=") + enc("9") + enc(">> <<2+2=") + enc("9") + enc(">> <<3+3=") + enc("9") + enc(">>") + [eos]
    engine = _engine(tokenizer, {"Q: three": three})
    row = _rows(engine, tokenizer, ["Q: three"], max_rounds=3)[0]
    text = tokenizer.decode(row.ids, skip_special_tokens=True)
    assert text == "<<1+1=2>> <<2+2=4>> <<3+3=9>>"  # two results forced, the third the policy's own
    assert len(engine.calls) == 3 and sum(row.forced) == 2 * len(enc("2>>")) and not row.truncated
    assert [c["params"][0].stop_token_ids for c in engine.calls][-1] == [eos]  # the last round: the EOS only
    uncapped = _rows(_engine(tokenizer, {"Q: three": three}), tokenizer, ["Q: three"])[0]
    assert tokenizer.decode(uncapped.ids, skip_special_tokens=True) == "<<1+1=2>> <<2+2=4>> <<3+3=6>>"
    # a row that writes nothing but "=" ends at the cap or its budget, whichever comes first
    equals = _engine(tokenizer, {"Q: equals": [enc("=")[0]] * 50})
    row = _rows(equals, tokenizer, ["Q: equals"], max_tokens=40, max_rounds=5)[0]
    assert len(equals.calls) == 5 and len(row.ids) == 40 and row.truncated
    row = _rows(_engine(tokenizer, {"Q: equals": [enc("=")[0]] * 50}), tokenizer, ["Q: equals"], max_tokens=7)[0]
    assert len(row.ids) == 7 and row.truncated and sum(row.forced) == 0


def test_rows_ending_at_the_eos_stop_and_repeated_prompts_each_get_a_row(scripted, tokenizer):
    scripts, expected = scripted
    engine = _engine(tokenizer, scripts)
    repeated = [p for p in ("Q: calls", "Q: plain") for _ in range(3)]  # TRL repeats each prompt G times
    rows = _rows(engine, tokenizer, repeated)
    assert [r.ids for r in rows] == [expected[p][0] for p in repeated]
    assert all(r.ids[-1] == tokenizer.eos_token_id and not r.truncated for r in rows)
    assert len(engine.calls) == 2 and len(engine.calls[0]["params"]) == 6  # one request (n=1) per row
    assert len(engine.calls[1]["params"]) == 6  # every row stopped at its "=" once; none after its EOS


def test_seeds_differ_per_row_and_round_and_repeat(scripted, tokenizer):
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts)
    _rows(engine, tokenizer, ["Q: calls", "Q: calls"], seed=5)
    seeds = [[p.seed for p in c["params"]] for c in engine.calls]
    assert seeds == [[row_seed(5, 0, 0), row_seed(5, 1, 0)], [row_seed(5, 0, 1), row_seed(5, 1, 1)]]
    assert len({s for round_ in seeds for s in round_}) == 4 and all(0 <= s < 2 ** 63 for r in seeds for s in r)
    assert row_seed(5, 1, 1) == row_seed(5, 1, 1) != row_seed(6, 1, 1) and row_seed(None, 0, 0) is None


def test_vllm_rollout_returns_trls_keys_logprobs_and_the_env_mask(scripted, tokenizer):
    scripts, expected = scripted
    engine = _engine(tokenizer, scripts)
    repeated = [p for p in scripts for _ in range(2)]
    out = _rollout(tokenizer)(repeated, _trainer(tokenizer, FakeGeneration(llm=engine)))
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
    assert out["prompt_ids"] == tokenizer(text=repeated)["input_ids"]
    assert out["completion_ids"] == [expected[p][0] for p in repeated]
    assert out["env_mask"] == [[1 - f for f in expected[p][1]] for p in repeated]
    for ids, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        assert len(ids) == len(mask) == len(logprobs)
        assert [lp is None for lp in logprobs] == [m == 0 for m in mask]  # None exactly where forced
    assert all(c["lora_request"] is None for c in engine.calls)  # TRL's own engine: TRL synced its weights


def test_vllm_rollout_samples_unsloths_engine_with_the_live_adapter(scripted, tokenizer):
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts, shared_weights=True)
    model = UnslothLikeModel()
    _rollout(tokenizer)(list(scripts), _trainer(tokenizer, FakeGeneration(llm=engine), model=model))
    assert model.loads == [(LIVE_ADAPTER, True)]  # once per rollout, as Unsloth's GRPO asks for it
    assert len(engine.calls) == 2 and all(c["lora_request"] == ("lora request", LIVE_ADAPTER, 1)
                                          for c in engine.calls)


def test_vllm_rollout_passes_trls_sampling_settings(scripted, tokenizer):
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts)
    generation = FakeGeneration(llm=engine, temperature=0.7, top_p=0.9, top_k=20, min_p=None, repetition_penalty=1.1,
                                generation_kwargs={"seed": 11, "max_tokens": 3, "n": 4})
    _rollout(tokenizer)(["Q: calls", "Q: calls"], _trainer(tokenizer, generation))
    first, second = engine.calls
    for round_, call in enumerate(engine.calls):
        for row, p in enumerate(call["params"]):
            assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.9, 20, 0.0, 1.1)
            assert p.n == 1 and p.seed == row_seed(11, row, round_)  # generation_kwargs' seed seeds each row's
    assert [p.max_tokens for p in first["params"]] == [30, 30]  # the budget is the loop's, not max_tokens=3


def test_sleep_mode_wakes_the_cache_and_sleeps_after_the_rounds(scripted, tokenizer):
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts)
    generation = FakeGeneration(llm=engine, enable_sleep_mode=True, _llm_weights_sleeping=True)
    _rollout(tokenizer)(list(scripts), _trainer(tokenizer, generation))
    # as TRL's VLLMGeneration.generate: slept weights re-pushed, the KV cache woken, level-2 sleep afterwards
    assert engine.events == ["sync_weights", "wake_up(kv_cache)", "generate", "generate", "sleep(2)"]
    assert generation._llm_weights_sleeping
    awake_weights = FakeGeneration(llm=_engine(tokenizer, scripts), enable_sleep_mode=True)
    _rollout(tokenizer)(list(scripts), _trainer(tokenizer, awake_weights))
    assert awake_weights.llm.events == ["wake_up(kv_cache)", "generate", "generate", "sleep(2)"]
    off = FakeGeneration(llm=_engine(tokenizer, scripts))
    _rollout(tokenizer)(list(scripts), _trainer(tokenizer, off))
    assert off.llm.events == ["generate", "generate"]


def test_vllm_rollout_refuses_a_trainer_without_vllm(scripted, tokenizer):
    """(The settings the rounds cannot take, a structured-outputs regex and tensor parallelism in colocate mode,
    are refused before any model loads: lowmem_grpo.combinations, tests/test_combinations.py.)"""
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts)
    trainer = _trainer(tokenizer, None)
    with pytest.raises(RecipeError, match="use_vllm"):
        _rollout(tokenizer)(["Q: calls"], trainer)
    assert engine.calls == []


def _recipe(*overrides: str):
    return load_recipe(str(CPU_RECIPE), list(overrides))


def test_the_plan_and_the_rollout_for_the_calculator_on_vllm(tokenizer):
    for backend, overrides in (("hf", ("train.use_vllm=true",)), ("unsloth", ("model.fast_inference=true",)),
                               ("hf", ("train.use_vllm=true", "train.top_p=0.9"))):
        plan = rollout_plan(_recipe("data.calculator=true", *overrides), backend, "cuda")
        assert plan.vllm and plan.calculator and not plan.engine, (backend, overrides)
        assert plan.describe() == "vLLM with the calculator"
        assert isinstance(make_rollout(plan, tokenizer), VllmRollout)
    for backend in ("hf", "unsloth"):  # off vLLM the engine samples with the calculator, on either backend
        engine = rollout_plan(_recipe("data.calculator=true"), backend, "cuda")
        assert not engine.vllm and isinstance(make_rollout(engine, tokenizer), EngineRollout)
    assert make_rollout(rollout_plan(_recipe(), "hf", "cuda"), tokenizer) is None  # TRL's generation
    assert not rollout_plan(_recipe("train.use_vllm=true"), "hf", "cuda").vllm  # no calculator: TRL's vLLM


# --- 3. generate()'s vLLM branch ----------------------------------------------------------------------------------

def test_generate_takes_the_calculator_on_vllm(scripted, tokenizer):
    scripts, expected = scripted
    engine = _engine(tokenizer, scripts, shared_weights=True)
    model = SimpleNamespace(vllm_engine=engine)  # what choose_engine takes for a model with a vLLM engine
    out = generate(model, tokenizer, list(scripts), max_new_tokens=30, progress=False, calculator=True,
                   lora_request="given", sampling_params_class=SamplingParams)
    calls, plain, refused = (samples[0] for samples in out)
    assert calls.text == "<<12-5=7>> apples" and calls.forced_tokens == len(_enc(tokenizer, "7>>"))
    assert not calls.truncated and calls.tokens == len(expected["Q: calls"][0])  # EOS counted, as the engine
    assert plain.text == "12-5=7 apples" and plain.forced_tokens == 0
    assert refused.text == "<<12/0=x>> done" and refused.forced_tokens == 0
    assert engine.calls[0]["token_ids"] == tokenizer(list(scripts))["input_ids"]  # tokenized as transformers'
    assert all(c["lora_request"] == "given" for c in engine.calls)
    assert all(p.temperature == 0.0 and p.top_k == 1 for c in engine.calls for p in c["params"])


def test_generate_samples_k_seeded_rows_per_problem_with_the_calculator(scripted, tokenizer):
    scripts, _ = scripted
    engine = _engine(tokenizer, scripts)
    out = generate(SimpleNamespace(vllm_engine=engine), tokenizer, ["Q: calls", "Q: plain"], max_new_tokens=5,
                   num_samples=2, temperature=0.7, seed=9, progress=False, calculator=True,
                   sampling_params_class=SamplingParams)
    assert [len(s) for s in out] == [2, 2]
    assert out[0][0].text == tokenizer.decode(_enc(tokenizer, "<<12-5=")) and out[0][0].truncated
    first = [p.seed for p in engine.calls[0]["params"]]
    assert first == [row_seed(9, r, 0) for r in range(4)]


# --- 4. what the loop relies on in TRL and Unsloth ----------------------------------------------------------------

PINNED = {  # (file under trl/, class, function) -> sha256 of its source, first 16 hex digits
    ("trainer/grpo_trainer.py", "GRPOTrainer", "_generate"): "8e74c57f8eff8e4e",
    ("generation/vllm_generation.py", "VLLMGeneration", "__init__"): "851e11bcf7f49f4b",
    ("generation/vllm_generation.py", "VLLMGeneration", "generate"): "9413ba1f7f1a1644",
    ("generation/vllm_generation.py", "VLLMGeneration", "sync_weights"): "9ce83a04fd3d9825",
}
"""TRL 1.15.0's code VllmRollout follows: the rollout_func seam (run after the weight sync, its keys, env_mask),
how TRL samples vLLM (its settings' names, TokensPrompts, n=1 per repeated prompt in colocate, sleep mode's
wake_up / sleep and the weights' re-push)."""


def _method(text: str, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} is gone")


def _installed(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    return Path(spec.origin).parent


def test_the_trl_code_the_vllm_rollout_follows_is_unchanged():
    """A drift guard read from the installed files (not imported): when one fails, re-read that function against
    VllmRollout (lowmem_grpo/sampling/rollout.py, lowmem_grpo/sampling/vllm_calculator.py, the sleep mode's
    vllm_awake in lowmem_grpo/train/trainer.py) and
    update its hash."""
    root = _installed("trl")
    for (path, cls, name), digest in PINNED.items():
        text = (root / path).read_text(encoding="utf-8")
        source = ast.get_source_segment(text, _method(text, cls, name))
        assert hashlib.sha256(source.encode()).hexdigest()[:16] == digest, f"TRL's {cls}.{name} changed"
    trainer = (root / "trainer" / "grpo_trainer.py").read_text(encoding="utf-8")
    score = ast.get_source_segment(trainer, _method(trainer, "GRPOTrainer", "_generate_and_score_completions"))
    # a None log-prob (a forced token) becomes NaN, and NaN differences become 0: no correction on those tokens
    assert 'torch.tensor([float("nan") if x is None else x for x in logps])' in score
    assert "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)" in score
    assert "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask" in score
    fields = [a.arg for a in _method((root / "generation" / "vllm_generation.py").read_text(encoding="utf-8"),
                                     "VLLMGeneration", "__init__").args.args]
    assert {f.name for f in FakeGeneration.__dataclass_fields__.values()} - {"llm", "_llm_weights_sleeping"} \
        <= set(fields)


def test_unsloth_hands_its_engine_to_trl_and_samples_it_with_the_live_adapter():
    """Unsloth 2026.10.9 (unsloth/models/rl_replacements.py, read as text: importing Unsloth needs a GPU): in TRL's
    VLLMGeneration its fast_inference engine is `llm`, marked shared_weights; its sync_weights pushes nothing but
    wakes a sleeping engine; its generate wrapper gives llm.generate `load_lora(name, load_tensors = True)`, which
    a direct llm.generate call (VllmRollout's) must pass itself."""
    text = (_installed("unsloth") / "models" / "rl_replacements.py").read_text(encoding="utf-8")
    assert "self.llm = model.vllm_engine" in text
    assert "if getattr(self.llm, 'shared_weights', False) and hasattr(model, 'load_lora'):" in text
    assert "self._unsloth_load_lora = model.load_lora" in text
    assert 'kwargs["lora_request"] = load_lora(lora_name, load_tensors = True)' in text
    assert "getattr(self, 'unsloth_fast_inference_lora', False)" in text and "self.llm.wake_up()" in text
    llama = (_installed("unsloth") / "models" / "llama.py").read_text(encoding="utf-8")
    assert "model.vllm_engine = llm" in llama and "llm.shared_weights = True" in llama
