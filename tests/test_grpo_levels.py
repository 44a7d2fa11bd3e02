"""data.generated.grpo_levels: GRPO draws from some levels while priming and the evaluations keep them all."""

from __future__ import annotations

import json

import pytest

from lowmem_grpo.data import grpo_examples
from lowmem_grpo.data.generated import generate_rows, level_of, level_shares
from lowmem_grpo.errors import DataError, RecipeError
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.recipe_rules import validate
from resilience_helpers import CPU_RECIPE, cli_inprocess, one_torch_thread, tiny_args  # noqa: F401


def _examples(levels: str, size: int = 12) -> list[dict]:
    return [{"question": r["question"], "solution": r["answer"]} for r in generate_rows("train", size, levels, 0)]


def _recipe(*overrides: str):
    return load_recipe(str(CPU_RECIPE), ["data.source=generated", *overrides])


def test_grpo_examples_keep_the_named_levels_and_every_example_without_them():
    examples = _examples("1-2")
    assert {level_of(e["question"], e["solution"]) for e in examples} == {1, 2}
    two = grpo_examples(examples, _recipe("data.generated.levels=1-2", "data.generated.grpo_levels=2").data)
    assert two and {level_of(e["question"], e["solution"]) for e in two} == {2}
    assert two == [e for e in examples if level_of(e["question"], e["solution"]) == 2]  # order kept
    assert grpo_examples(examples, _recipe("data.generated.levels=1-2").data) is examples
    with pytest.raises(DataError, match="no training problem of data.generated.grpo_levels=3"):
        grpo_examples(examples, _recipe("data.generated.levels=1-3", "data.generated.grpo_levels=3").data)


def test_a_level_named_k_times_weighs_k():
    assert level_shares("1,2,2,2") == {1: 0.25, 2: 0.75}
    assert level_shares("2") == {2: 1.0} and level_shares("1-2") == {1: 0.5, 2: 0.5}
    examples = _examples("1-2", size=200)
    levels = [level_of(e["question"], e["solution"]) for e in examples]
    mix = grpo_examples(examples, _recipe("data.generated.levels=1-2", "data.generated.grpo_levels=1,2,2,2").data)
    mixed = [level_of(e["question"], e["solution"]) for e in mix]
    # every two-step example (the scarcer side of a 1:3 mix) and a third as many one-step ones, in their order
    assert mixed.count(2) == levels.count(2) and mixed.count(1) == levels.count(2) // 3
    assert mix == [e for e in examples if e in mix]
    with pytest.raises(DataError, match="none of level 3"):
        grpo_examples(examples, _recipe("data.generated.levels=1-3", "data.generated.grpo_levels=2,3").data)


def test_grpo_levels_must_be_some_of_the_generated_levels():
    validate(_recipe("data.generated.levels=1,2", "data.generated.grpo_levels=2"))
    with pytest.raises(RecipeError, match=r"names level\(s\) 3 that data.generated.levels \(1,2\) does not draw"):
        validate(_recipe("data.generated.levels=1,2", "data.generated.grpo_levels=2-3"))
    with pytest.raises(RecipeError, match="data.generated.grpo_levels"):
        validate(_recipe("data.generated.levels=1,2", "data.generated.grpo_levels=two"))
    with pytest.raises(RecipeError, match="but data.source is 'embedded'"):
        validate(load_recipe(str(CPU_RECIPE), ["data.source=embedded", "data.generated.grpo_levels=2"]))


@pytest.mark.slow
def test_a_run_primes_on_every_level_and_trains_grpo_on_the_named_ones(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, "data.source=generated", "data.generated.levels=1-2",
                                         "data.generated.grpo_levels=2", "data.generated.train_size=16",
                                         "prime.enabled=true", "prime.max_steps=1", steps=2, save_steps=2))
    assert code == 0, log[-3000:]
    rows = generate_rows("train", 16, "1-2", 0)
    level = {r["question"]: level_of(r["question"], r["answer"]) for r in rows}
    two = sum(v == 2 for v in level.values())
    assert f"priming 1 steps on {len(rows)} rendered solutions" in log
    assert f"GRPO draws from {two} of {len(rows)} training problems (data.generated.grpo_levels=2)" in log
    lines = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert lines and {level[line["question"]] for line in lines} == {2}


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_the_chains_recipe_is_the_cpu_default_on_one_and_two_step_problems():
    from lowmem_grpo import DEFAULT_RECIPE
    from lowmem_grpo.data import load_train_rows
    from lowmem_grpo.data.format import primed_count
    from lowmem_grpo.recipe_io import recipe_to_dict

    chains, default = load_recipe("recipes/smollm2_135m_chains_cpu.py"), load_recipe(DEFAULT_RECIPE)
    validate(chains)
    before = _flat(recipe_to_dict(default))
    differs = {k for k, v in _flat(recipe_to_dict(chains)).items() if before[k] != v}
    # rewards and the stage evaluation stay the default's: the problems, priming's size and how advantages are
    # scaled move (per group: the one-step answers held on three seeds, docs/results.md)
    assert differs == {"name", "description", "data.generated.levels", "data.generated.grpo_levels",
                       "prime.num_examples", "prime.max_steps", "train.max_completion_length", "train.scale_rewards"}
    assert chains.train.extra["scale_rewards"] == "group" and default.train.extra["scale_rewards"] == "batch"
    rows = load_train_rows(chains.data)
    primed = rows[:primed_count(len(rows), chains.prime.num_examples)]  # what priming trains on
    assert {level_of(r["question"], r["answer"]) for r in primed} == {1, 2}
    grpo = grpo_examples([{"question": r["question"], "solution": r["answer"]} for r in rows], chains.data)
    shares = level_shares(chains.data.generated.grpo_levels)
    counts = [level_of(e["question"], e["solution"]) for e in grpo]
    assert shares[2] > shares[1] and counts.count(1) == pytest.approx(len(counts) * shares[1], abs=2)
