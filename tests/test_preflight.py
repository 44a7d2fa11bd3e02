"""The reward preflight's verdict on synthetic reward tables, the problems it draws, and its second look before a
refusal: no model involved (the sampling engine is replaced by a fake that writes chosen completions)."""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

import pytest

from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import apply_overrides
from lowmem_grpo.train.preflight import PreflightResult, fixes, group_stats, render
from tiny_run import cpu_runtime

RIGHT = "<reasoning>\n3 + 15 = 18\n</reasoning>\n<answer>\n18\n</answer>"
WRONG = "<reasoning>\n3 + 14 = 17\n</reasoning>\n<answer>\n17\n</answer>"


def _table(goal_varies: int, groups: int, *, format_varies: int = 0, size: int = 8,
           goal: str | None = "correctness") -> PreflightResult:
    """A preflight result whose goal reward (correctness, weight 2) varies in the first `goal_varies` of `groups`
    groups of `size` and the format reward (strict_format, weight 0.5) in the first `format_varies`."""
    varying = [0.0, 1.0] + [0.0] * (size - 2)
    correct = [v for g in range(groups) for v in (varying if g < goal_varies else [0.0] * size)]
    fmt = [v for g in range(groups) for v in (varying if g < format_varies else [1.0] * size)]
    totals = [2 * c + 0.5 * f for c, f in zip(correct, fmt)]
    stats, frac = group_stats({"correctness": correct, "strict_format": fmt, "total": totals},
                              {"correctness": 2.0, "strict_format": 0.5}, size)
    return PreflightResult(stats, frac, groups, size, 1.0, goal=goal)


def test_no_group_varying_is_refused_with_the_shares_and_the_fix():
    recipe = Recipe()
    flat = _table(0, 16)
    assert flat.goal_share == 0.0 and flat.total_share == 0.0
    assert flat.no_signal and not flat.weak and not flat.format_only
    text = render(flat, recipe)
    assert ("NO SIGNAL: the goal reward correctness varies in 0 of 16 prompt groups (0%), the weighted total in "
            "0 of 16 (0%)") in text
    assert "prime.enabled=true" in text and "train.preflight.allow_no_signal=true" in text and "ok:" not in text
    # the total varies (format) in every group, the goal in none: refused, with the fixes for the goal
    only_format = _table(0, 16, format_varies=16)
    assert only_format.no_signal and only_format.format_only and only_format.total_share == 1.0
    text = render(only_format, recipe)
    assert "NO SIGNAL ON THE GOAL: the goal reward correctness varies in 0 of 16" in text
    assert "easier problems" in text and fixes(recipe, only_format)[0].startswith("easier problems")


def test_nothing_earned_names_format_priming_first():
    recipe = Recipe()
    stats, frac = group_stats({"correctness": [0.0] * 8, "total": [0.0] * 8}, {"correctness": 2.0}, 4)
    result = PreflightResult(stats, frac, 2, 4, 1.0, samples=[{"prompt_index": 0, "completion": "hi",
                                                                "scores": {"total": 0.0}}])
    text = render(result, recipe)
    assert result.no_signal and "sample 1 (prompt 0): total=0.000" in text
    assert text.index("prime.enabled=true") < text.index("partial-credit") < text.index("num_generations")
    assert "temperature" in fixes(recipe, result)[3] and "data.prefill" in fixes(recipe, result)[4]


def test_a_goal_varying_in_one_group_of_sixteen_warns_and_goes_on():
    result = _table(1, 16, format_varies=16)
    assert not result.no_signal and result.weak_goal and not result.weak_total and result.weak
    assert result.goal_share == pytest.approx(1 / 16)
    text = render(result, Recipe())
    assert ("WEAK SIGNAL: the goal reward correctness varies in 1 of 16 prompt groups (6%), the weighted total in "
            "16 of 16 (100%)") in text
    assert "may learn the format instead of the answers" in text and "easier problems" in text
    assert "NO SIGNAL" not in text and "train.preflight.allow_no_signal" not in text


def test_the_demo_draw_three_of_eight_informative_goes_on():
    """The draw that stopped `make demo`: 5 of 8 groups flat on the total (3 vary, on the goal too) was refused as
    NO SIGNAL ("most groups flat"); three varying groups are a signal, a thin one."""
    result = _table(3, 8)
    assert result.frac_zero_std == pytest.approx(5 / 8)
    assert not result.no_signal and result.weak_goal and result.weak_total
    text = render(result, Recipe())
    assert "WEAK SIGNAL: the goal reward correctness varies in 3 of 8 prompt groups (38%)" in text
    assert "NO SIGNAL" not in text
    # the goal is reached in some groups, so the format is in reach: the fixes are the goal's, not priming the format
    assert "1. easier problems" in text and "format priming" not in text


def test_a_total_varying_in_almost_no_group_is_refused():
    from lowmem_grpo.train.preflight import MIN_TOTAL_SHARE

    one_in_40 = _table(1, 40)  # the goal varies in one group, so the total in that one only: 2.5%
    assert one_in_40.total_share < MIN_TOTAL_SHARE and one_in_40.goal_share > 0
    assert one_in_40.no_signal and not one_in_40.weak
    assert "NO SIGNAL: the goal reward correctness varies in 1 of 40 prompt groups (3%), the weighted total in " \
           "1 of 40 (3%); below 5% of the groups is almost none" in render(one_in_40, Recipe())
    # no goal named: judged on the total alone; one varying group of 16 is a signal (6%), none is not
    assert _table(1, 40, goal=None).no_signal
    weak = _table(1, 16, goal=None)
    assert not weak.no_signal and weak.weak_total and weak.goal_share is None
    assert "WEAK SIGNAL: the weighted total varies in 1 of 16 prompt groups (6%; no goal reward named)" in \
           render(weak, Recipe())
    assert _table(0, 16, goal=None).no_signal


def test_a_strong_signal_is_ok():
    result = _table(12, 16, format_varies=16)
    assert not (result.no_signal or result.weak or result.format_only)
    assert ("ok: the goal reward correctness varies in 12 of 16 prompt groups (75%), the weighted total in 16 of 16 "
            "(100%); GRPO has a signal") in render(result, Recipe())


def _examples(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "answer": "18", "question": f"q{i}", "solution": "#### 18", "prefill": ""}
            for i in range(n)]


def test_the_preflight_draws_problems_spread_over_the_training_set():
    from lowmem_grpo.train.preflight import preflight_examples

    examples = _examples(200)
    recipe = apply_overrides(Recipe(), ["prime.enabled=true", "prime.num_examples=40", "train.seed=42"])
    chosen = [int(e["prompt"][1:]) for e in preflight_examples(recipe, examples, 16)]
    assert len(set(chosen)) == 16 and min(chosen) >= 40  # problems priming did not train on
    ordered = sorted(chosen)
    assert ordered != list(range(ordered[0], ordered[0] + 16))  # not a contiguous block
    assert ordered[0] < 40 + 40 and ordered[-1] >= 200 - 40  # from both ends of the unprimed 40..199
    again = [int(e["prompt"][1:]) for e in preflight_examples(recipe, examples, 16)]
    assert again == chosen  # deterministic with the seed
    other = apply_overrides(recipe, ["train.seed=7"])
    assert [int(e["prompt"][1:]) for e in preflight_examples(other, examples, 16)] != chosen
    # a smaller draw is the start of a larger one: a second look adds problems, never swaps them
    assert [int(e["prompt"][1:]) for e in preflight_examples(recipe, examples, 8)] == chosen[:8]


def test_generated_problems_are_drawn_in_proportion_to_their_levels():
    from lowmem_grpo.data.generated import generate_rows, level_of
    from lowmem_grpo.train.preflight import preflight_examples

    rows = generate_rows("train", 300, "1-3", 0)
    examples = [{"prompt": r["question"], "question": r["question"], "solution": r["answer"]} for r in rows]
    levels = Counter(level_of(r["question"], r["answer"]) for r in rows)
    recipe = apply_overrides(Recipe(), ["data.source=generated", "prime.enabled=false"])
    for n in (8, 12, 30):
        drawn = Counter(level_of(e["question"], e["solution"]) for e in preflight_examples(recipe, examples, n))
        for level, count in levels.items():
            assert abs(drawn[level] - n * count / len(rows)) <= 1, (n, level, drawn, levels)


def test_too_few_fresh_problems_are_topped_up_from_primed_ones_with_a_warning(caplog):
    from lowmem_grpo.train.preflight import preflight_examples

    examples = _examples(10)
    primed = apply_overrides(Recipe(), ["prime.enabled=true", "prime.num_examples=6"])
    assert sorted(e["prompt"] for e in preflight_examples(primed, examples, 4)) == ["p6", "p7", "p8", "p9"]
    base = preflight_examples(primed, examples, 3, primed=False)  # the base model: every problem is fresh
    assert len(base) == 3 and len({e["prompt"] for e in base}) == 3
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):  # priming saw all: primed ones, with a warning
        everything = apply_overrides(Recipe(), ["prime.enabled=true"])
        assert len(preflight_examples(everything, examples, 2)) == 2
    assert "2 of its 2 prompts were primed on" in caplog.text


class FakeEngine:
    """Stands in for lowmem_grpo.sampling.generate.generate: the completions of the prompts in `varying` are half
    right, half wrong; the others all wrong."""

    def __init__(self, varying: set[str]) -> None:
        self.varying = varying
        self.calls: list[list[str]] = []

    def __call__(self, model, tokenizer, prompts, *, num_samples=1, **kwargs):
        self.calls.append(list(prompts))
        return [[SimpleNamespace(text=RIGHT if p in self.varying and j % 2 else WRONG) for j in range(num_samples)]
                for p in prompts]


def _run(monkeypatch, varying: set[str], n_prompts: int, refusal_prompts: int, n_examples: int = 100):
    from lowmem_grpo.train import preflight as module

    engine = FakeEngine(varying)
    monkeypatch.setattr(module, "generate", engine)
    recipe = apply_overrides(Recipe(), ["prime.enabled=false", "train.num_generations=4"])
    loaded = SimpleNamespace(model=None, tokenizer=None, runtime=cpu_runtime(recipe))
    result = module.preflight(recipe, loaded, _examples(n_examples), n_prompts, refusal_prompts=refusal_prompts)
    return result, engine


def test_no_signal_on_a_few_prompts_is_checked_on_more_before_a_refusal(monkeypatch):
    from lowmem_grpo.train.preflight import PREFLIGHT_MIN_PROMPTS

    _, probe = _run(monkeypatch, set(), 8, PREFLIGHT_MIN_PROMPTS)
    first, second = probe.calls  # nothing varies: 8 prompts, then 8 more of the same draw, then the refusal
    assert len(first) == len(second) == 8 and not set(first) & set(second)
    # the first 8 are flat, a later one varies: a signal after all
    result, engine = _run(monkeypatch, {second[3]}, 8, PREFLIGHT_MIN_PROMPTS)
    assert engine.calls == [first, second]
    assert result.num_prompts == 16 and not result.no_signal and result.weak_goal
    assert result.goal_share == pytest.approx(1 / 16)
    refused, _ = _run(monkeypatch, set(), 8, PREFLIGHT_MIN_PROMPTS)
    assert refused.no_signal and refused.num_prompts == 16
    # a signal in the first draw: no second look; and a set smaller than the floor is judged on all it has
    ok, engine = _run(monkeypatch, set(first), 8, PREFLIGHT_MIN_PROMPTS)
    assert len(engine.calls) == 1 and not ok.no_signal and ok.num_prompts == 8
    small, engine = _run(monkeypatch, set(), 4, PREFLIGHT_MIN_PROMPTS, n_examples=10)
    assert [len(c) for c in engine.calls] == [4, 6] and small.num_prompts == 10 and small.no_signal


def test_train_refuses_no_signal_with_exit_3_and_warns_on_a_weak_one(monkeypatch, caplog):
    from lowmem_grpo.errors import EXIT_NO_SIGNAL, NoSignalError
    from lowmem_grpo.train import preflight as module
    from lowmem_grpo.train.pipeline import require_reward_signal

    recipe = apply_overrides(Recipe(), ["prime.enabled=false", "train.num_generations=4",
                                        "train.preflight.prompts=8"])
    loaded = SimpleNamespace(model=None, tokenizer=None, runtime=cpu_runtime(recipe))
    examples = _examples(100)
    monkeypatch.setattr(module, "generate", FakeEngine(set()))
    with pytest.raises(NoSignalError) as refused:
        require_reward_signal(recipe, loaded, examples)
    assert refused.value.exit_code == EXIT_NO_SIGNAL
    message = str(refused.value)
    assert "the goal reward correctness varies in 0 of 16 prompt groups (0%), the weighted total in 0 of 16" in message
    assert "fix:" in message and "train.preflight.allow_no_signal=true" in message
    allowed = apply_overrides(recipe, ["train.preflight.allow_no_signal=true"])
    assert require_reward_signal(allowed, loaded, examples).no_signal
    # the goal varies in 3 of 8: a warning with the share, and the run goes on
    monkeypatch.setattr(module, "generate", FakeEngine({f"p{i}" for i in range(0, 100, 3)}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):
        check = require_reward_signal(recipe, loaded, examples)
    assert not check.no_signal and check.weak_goal and check.num_prompts == 8
    assert "WEAK SIGNAL: the goal reward correctness varies in" in caplog.text
