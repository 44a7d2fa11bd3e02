"""The completion budget against the rendered targets (lowmem_grpo.data.budget): counted, refused, skipped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lowmem_grpo.data.budget import check_budget, check_recipe_budget, fit_budget, load_tokenizer
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe_io import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CPU_RECIPE = str(RECIPES / "smollm2_135m_gsm8k_cpu.py")


def test_fit_counts_cut_and_no_room_for_the_end_of_turn_and_names_the_budget_that_fits():
    lengths = [10] * 96 + [47, 48, 49, 60]  # + 1 each for the end-of-turn token
    fit = fit_budget(lengths, 48, 0.02)
    assert (fit.cut, fit.no_eos, fit.unfinished, fit.targets) == (2, 1, 3, 100)
    assert fit.share == pytest.approx(0.03) and not fit.fits
    assert fit.fitting_budget == 49  # 98 of 100 finish within 49: 48 (+1) and everything shorter
    again = fit_budget(lengths, fit.fitting_budget, 0.02)
    assert again.fits and again.unfinished == 2
    assert fit_budget(lengths, 61, 0.0).unfinished == 0 and fit_budget(lengths, 61, 0.0).fitting_budget == 61


def test_a_budget_that_cuts_the_worked_solutions_is_refused_with_the_one_that_fits(tiny_model_dir):
    from lowmem_grpo.data import load_train_rows

    recipe = load_recipe(CPU_RECIPE, [f"model.name={tiny_model_dir}", "train.max_completion_length=16"])
    rows = load_train_rows(recipe.data)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(RecipeError) as info:
        check_budget(recipe, rows, tokenizer)
    message = str(info.value)
    assert "train.max_completion_length=16" in message and f"of {len(rows)} worked solutions" in message
    fitting = int(message.split("set train.max_completion_length=")[1].split()[0])
    assert fitting > 16
    recipe.train.max_completion_length = fitting
    fit = check_budget(recipe, rows, tokenizer)
    assert fit.fits and fit.share <= 0.02
    recipe.train.max_completion_length = fitting - 1
    with pytest.raises(RecipeError):  # the smallest: one token less does not fit
        check_budget(recipe, rows, tokenizer)
    recipe.train.max_truncated_targets = 1.0  # the check turned off
    assert check_budget(recipe, rows, tokenizer) is None


def test_the_budget_counts_the_calculator_form_of_the_targets():
    from lowmem_grpo.data import load_train_rows
    from lowmem_grpo.data.budget import target_lengths

    rows = load_train_rows(load_recipe(CPU_RECIPE).data)[:20]
    solutions = [row["answer"] for row in rows]

    def count(texts):
        return [len(text) for text in texts]

    plain = target_lengths(solutions, "<reasoning>\n", count)
    calculator = target_lengths(solutions, "<reasoning>\n", count, calculator=True)
    assert calculator != plain  # the annotations are rendered, not removed
    recipe = load_recipe(CPU_RECIPE, ["data.calculator=true", "train.max_completion_length=16"])

    class Tokenizer:  # one token per character
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(text) for text in texts]}

    with pytest.raises(RecipeError) as info:
        check_budget(recipe, rows, Tokenizer())
    fitting = int(str(info.value).split("set train.max_completion_length=")[1].split()[0])
    assert fitting == sorted(n + 1 for n in calculator)[-1]  # the longest calculator target, + the end of turn


def test_validate_refuses_a_budget_that_does_not_fit_with_exit_2(tiny_model_dir, caplog):
    from lowmem_grpo.cli import main

    with caplog.at_level(logging.ERROR, logger="lowmem_grpo"):
        code = main(["validate", CPU_RECIPE, f"model.name={tiny_model_dir}", "train.max_completion_length=16"])
    assert code == 2
    assert "cannot finish in the answer format" in caplog.text and "fix: set train.max_completion_length=" in caplog.text


def test_without_data_or_tokenizer_here_the_check_is_skipped_with_a_log_line(caplog):
    recipe = load_recipe(CPU_RECIPE)

    def no_network() -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):
        assert check_recipe_budget(recipe, no_network) is None
    assert "completion budget: not checked" in caplog.text and "couldn't connect" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2_135m_arith_cpu", "smollm2_135m_chains_cpu", "smollm2_135m_gsm8k_cpu"])
def test_the_shipped_cpu_recipes_budgets_fit_their_worked_solutions(name):
    """The recipes whose data is here (embedded, generated) pass the check with the embedded model's tokenizer."""
    from lowmem_grpo.backends import locate_model
    from lowmem_grpo.data import load_train_rows

    recipe = load_recipe(str(RECIPES / f"{name}.py"))
    fit = check_budget(recipe, load_train_rows(recipe.data), load_tokenizer(locate_model(recipe.model.name)))
    assert fit is not None and fit.fits, fit
    assert recipe.data.max_prompt_length + recipe.train.max_completion_length <= recipe.model.max_seq_length


def test_train_refuses_the_budget_before_the_model_loads_and_writes_nothing(tiny_model_dir, tmp_path):
    from lowmem_grpo.train.pipeline import train

    run_dir = tmp_path / "run"
    recipe = load_recipe(CPU_RECIPE, [f"model.name={tiny_model_dir}", "model.backend=hf", f"output.dir={run_dir}",
                                      "train.max_completion_length=16"])
    with pytest.raises(RecipeError, match="cannot finish in the answer format"):
        train(recipe)
    assert not run_dir.exists()
