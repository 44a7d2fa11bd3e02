"""`lowmem-grpo eval` and `check-rewards` end to end on the tiny model and the embedded test split."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_grpo.cli import main
from lowmem_grpo.errors import EXIT_BAD_INPUT, EXIT_NO_SIGNAL, EXIT_OK, RecipeError
from tiny_run import cpu_runtime

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
CORE = ["strict_accuracy", "lenient_accuracy", "strict_format_rate", "soft_format_rate",
        "mean_completion_tokens", "truncated_rate"]


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A 2-step GRPO run of the CPU recipe on the tiny model (adapter/ and recipe.yaml inside)."""
    from tiny_run import train_tiny

    path, _ = train_tiny(tiny_model_dir, tmp_path_factory.mktemp("eval-run") / "run", "train.max_steps=2",
                         "train.preflight.enabled=false")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def eval_args(model: Path | str, out: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model), "--data", "embedded", "--max-new-tokens", "8", "--out", str(out),
            "--no-progress", *extra]


def test_eval_writes_metrics_records_and_table(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(eval_args(tiny_model_dir, out, "--limit", "3", "--prefill", "<reasoning>\\n")) == EXIT_OK
    report = json.loads((out / "eval.json").read_text())
    assert set(CORE) <= set(report["metrics"])
    assert report["metrics"]["num_problems"] == 3
    assert report["settings"]["prefill"] == "<reasoning>\n" and report["settings"]["split"] == "test"
    assert report["settings"]["temperature"] == 0.0 and report["settings"]["engine"] == "transformers"
    assert report["versions"]["transformers"] and report["versions"]["torch"]
    assert report["runs"]["model"]["problems_per_minute"] > 0
    records = read_jsonl(out / "eval.jsonl")
    assert len(records) == 3
    first_problem = json.loads((REPO / "lowmem_grpo/resources/gsm8k/test.jsonl").read_text().splitlines()[0])
    assert records[0]["question"] == first_problem["question"]
    assert records[0]["gold"] == first_problem["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    for r in records:
        assert r["completion"].startswith("<reasoning>\n")  # scored as prefill + generated text
        assert r["completion_tokens"] <= 8
        if r["truncated"]:
            assert r["completion_tokens"] == 8
        for key in ("extracted_answer", "last_number", "strict_correct", "lenient_correct", "strict_format",
                    "soft_format"):
            assert key in r
    # what the answers got wrong: every outcome a key, shares of the 3 problems' first answers
    from lowmem_grpo.rewards.calculator import OUTCOMES

    assert list(report["outcomes"]) == list(OUTCOMES) and report["runs"]["model"]["outcomes"] == report["outcomes"]
    for name in OUTCOMES:
        assert report["outcomes"][name] == sum(r["outcome"] == name for r in records) / 3
    table = capsys.readouterr().out
    assert "| strict_accuracy |" in table and "| truncated_rate |" in table and "problems/min" in table


def test_same_seed_same_sampled_result(tiny_model_dir, tmp_path):
    outs = [tmp_path / name for name in ("a", "b", "c")]
    for out, seed in zip(outs, ("5", "5", "6")):
        args = eval_args(tiny_model_dir, out, "--limit", "3", "--samples", "3", "--temperature", "1.0",
                         "--seed", seed)
        assert main(args) == EXIT_OK
    a, b, c = (read_jsonl(out / "eval.jsonl") for out in outs)
    texts = [[s["completion"] for s in r["samples"]] for r in a]
    assert texts == [[s["completion"] for s in r["samples"]] for r in b]
    assert texts != [[s["completion"] for s in r["samples"]] for r in c]
    metrics = json.loads((outs[0] / "eval.json").read_text())["metrics"]
    assert {"pass@3", "mean@3", "lenient_pass@3"} <= set(metrics)
    assert metrics["num_completions"] == 9


def test_compare_base_and_adapter_on_the_same_problems(run_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(eval_args(run_dir, out, "--limit", "4", "--compare")) == EXIT_OK
    report = json.loads((out / "eval.json").read_text())
    assert report["settings"]["adapter"] == str(run_dir / "adapter")
    assert report["settings"]["prefill"] == "<reasoning>\n"  # the run's recipe.yaml
    assert set(report["runs"]) == {"base", "adapter"}
    for metric in CORE:
        row = report["comparison"][metric]
        assert row["low"] <= row["diff"] <= row["high"]
        assert row["diff"] == pytest.approx(row["adapter"] - row["base"])
    records = read_jsonl(out / "eval.jsonl")
    base = [r for r in records if r["variant"] == "base"]
    adapter = [r for r in records if r["variant"] == "adapter"]
    assert [r["question"] for r in base] == [r["question"] for r in adapter] and len(base) == 4
    table = capsys.readouterr().out
    assert "| metric | base | adapter | diff | 95% CI |" in table
    # the same seed gives the same comparison, CI included
    again = tmp_path / "cmp2"
    assert main(eval_args(run_dir, again, "--limit", "4", "--compare")) == EXIT_OK
    assert json.loads((again / "eval.json").read_text())["comparison"] == report["comparison"]


def test_eval_command_from_a_run_dir_uses_its_recipe(run_dir):
    """The installed entry point, defaults from recipe.yaml (embedded data), output under the run."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "eval", "--model", str(run_dir), "--limit", "2",
                           "--max-new-tokens", "4", "--no-progress"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| strict_accuracy |" in proc.stdout and "+ adapter" in proc.stdout
    written = list((run_dir / "eval").glob("test-*/eval.json"))
    assert len(written) == 1
    assert json.loads(written[0].read_text())["settings"]["data"] == "embedded"


def test_eval_bad_input_exits_2(tiny_model_dir, tmp_path, capsys):
    assert main(eval_args(tiny_model_dir, tmp_path / "x", "--compare")) == EXIT_BAD_INPUT  # no adapter
    assert main(eval_args(tiny_model_dir, tmp_path / "x", "--adapter", str(tmp_path))) == EXIT_BAD_INPUT
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "missing.jsonl")]) == EXIT_BAD_INPUT
    assert main(eval_args(tiny_model_dir, tmp_path / "x", "--samples", "2")) == EXIT_BAD_INPUT  # greedy x 2
    assert main(eval_args(tiny_model_dir, tmp_path / "x", "--limit", "0")) == EXIT_BAD_INPUT


def test_a_refused_eval_leaves_no_folder_it_made_and_a_users_folder_as_it_was(tiny_model_dir, tmp_path):
    """--engine vllm where vLLM is not installed is refused after --out is made (so that an unwritable one is
    named before the model loads): nothing of it is left, and a folder the user made keeps only what it had."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: --engine vllm is not refused")
    out = tmp_path / "evals" / "first"
    assert main(eval_args(tiny_model_dir, out, "--engine", "vllm")) == EXIT_BAD_INPUT
    assert not (tmp_path / "evals").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(eval_args(tiny_model_dir, mine, "--engine", "vllm")) == EXIT_BAD_INPUT
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_an_adapter_is_found_in_a_run_dir_its_newest_checkpoint_by_step(tmp_path):
    from lowmem_grpo.errors import BadInputError
    from lowmem_grpo.evaluation.command import find_adapter

    with pytest.raises(BadInputError, match="checkpoint-N"):
        find_adapter(tmp_path)
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    (tmp_path / "checkpoint-11").mkdir()  # no adapter in it (yet)
    assert find_adapter(tmp_path) == tmp_path / "checkpoint-10"  # 10 after 9 and 2, not as text sorts them
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert find_adapter(tmp_path) == tmp_path / "adapter"


def check_rewards(model_dir: Path, *extra: str) -> list[str]:
    return ["check-rewards", CPU_RECIPE, f"model.name={model_dir}", "train.max_completion_length=16", *extra,
            "--prompts", "2"]


def test_check_rewards_reports_no_signal_for_gsm8k_rewards_on_a_random_model(tiny_model_dir, capsys):
    assert main(check_rewards(tiny_model_dir, "prime.enabled=false")) == EXIT_NO_SIGNAL  # the recipe primes
    out = capsys.readouterr().out
    assert "NO SIGNAL" in out and "prime.enabled=true" in out
    assert "| weighted total |" in out and "| correctness | 2 |" in out
    assert out.count("sample ") >= 2


def test_check_rewards_passes_for_a_reward_that_varies(tiny_model_dir, capsys):
    code = main(check_rewards(tiny_model_dir, "rewards={lowmem_test_rewards:length_reward: 1.0}"))
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "ok:" in out and "NO SIGNAL" not in out


def _strong_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter of the tiny model (the CPU recipe's r, alpha and targets) large enough to change its samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(out)
    return out


def _samples(out: str) -> list[str]:
    """The sample completions check-rewards printed (the lines after each `sample N` header)."""
    blocks = out.split("\nsample ")[1:]
    return [block.split("\n", 1)[1].split("\n\n", 1)[0] for block in blocks]


def test_check_rewards_samples_the_recipes_init_adapter(tiny_model_dir, tmp_path, capsys, caplog):
    adapter = _strong_adapter(tiny_model_dir, tmp_path / "adapter")
    common = ("prime.enabled=false", "model.dtype=float32", "rewards={lowmem_test_rewards:length_reward: 1.0}")
    main(check_rewards(tiny_model_dir, *common))
    base = capsys.readouterr().out
    main(check_rewards(tiny_model_dir, *common, f"lora.init_adapter={adapter}"))
    adapted, err = capsys.readouterr()
    assert _samples(base) and len(_samples(adapted)) == len(_samples(base)), err[-2000:]
    assert _samples(adapted) != _samples(base)  # the adapter's samples, not the base model's
    assert f"sampled: base model {tiny_model_dir} (no adapter)" in base, base[:600]
    assert f"sampled: adapter {adapter} on {tiny_model_dir}" in adapted, adapted[:600]

    other = tmp_path / "other"  # an adapter that does not fit the recipe stops before sampling, as train does
    _strong_adapter(tiny_model_dir, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with caplog.at_level(logging.ERROR, logger="lowmem_grpo"):  # main() reports a BadInputError with log.error
        assert main(check_rewards(tiny_model_dir, *common, f"lora.init_adapter={other}")) == EXIT_BAD_INPUT
    assert "its rank is 8, lora.r is 16" in caplog.text and "fix: set lora.r=8" in caplog.text, caplog.text
    assert not _samples(capsys.readouterr().out)  # refused before sampling


def test_periodic_eval_callback_logs_eval_metrics(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerControl, TrainerState

    from lowmem_grpo.train.callbacks import PeriodicEvalCallback
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(CPU_RECIPE, [f"model.name={tiny_model_dir}", "train.eval.every=2", "train.eval.problems=2",
                                      "train.max_completion_length=8"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    callback = PeriodicEvalCallback(recipe, tokenizer, tmp_path, cpu_runtime(recipe))
    for step in (1, 2):
        callback.on_step_end(None, TrainerState(global_step=step), TrainerControl(), model=model)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(lines) == 1 and lines[0]["stage"] == "eval" and lines[0]["step"] == 2
    assert lines[0]["eval/num_problems"] == 2 and "eval/strict_accuracy" in lines[0] and "eval/reward" in lines[0]
    assert model.training  # restored after generating


def test_preflight_as_train_calls_it_on_the_fresh_lora_model(tiny_model_dir):
    """preflight(recipe, loaded, examples, n) on the LoRA-wrapped model train() builds, left in train mode."""
    from lowmem_grpo.backends import load, start
    from lowmem_grpo.data import build_examples, load_rows
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.train.preflight import preflight
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(CPU_RECIPE, [f"model.name={tiny_model_dir}", "train.max_completion_length=8",
                                      "rewards={correctness: 2.0, lowmem_test_rewards:length_reward: 1.0}"])
    loaded = load(recipe, start(recipe, Launch())[0])
    loaded.model.train()
    d = recipe.data
    examples = build_examples(load_rows("embedded", "train")[:3], loaded.tokenizer, d.system_prompt, d.prefill,
                              d.max_prompt_length)
    result = preflight(recipe, loaded, examples, 2)
    assert (result.num_prompts, result.num_generations) == (2, recipe.train.num_generations)
    assert [s.name for s in result.rewards] == ["correctness", "lowmem_test_rewards:length_reward", "total"]
    assert result.rewards[0].mean == 0.0 and result.rewards[0].frac_zero_std == 1.0
    # the total varies (length), the goal reward (correctness) in no group: the only signal is not the goal's
    assert result.frac_zero_std == 0.0 and result.goal == "correctness" and result.goal_frac_zero_std == 1.0
    assert result.format_only and result.no_signal
    assert result.samples[0]["completion"].startswith("<reasoning>\n") and loaded.model.training


def test_preflight_and_eval_fields_never_reach_grpo_config(tmp_path):
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.recipe_rules import validate
    from lowmem_grpo.train.grpo import build_grpo_config, check_trainer_fields

    recipe = load_recipe(CPU_RECIPE, ["train.preflight.enabled=false", "train.preflight.prompts=2",
                                      "train.preflight.allow_no_signal=true", "train.eval.every=5",
                                      "train.eval.problems=10"])
    validate(recipe)
    check_trainer_fields(recipe)
    assert recipe.train.extra == {}
    config = build_grpo_config(recipe, tmp_path, cpu_runtime(recipe), [1.0])
    assert not any(hasattr(config, k) for k in ("preflight", "eval", "memory", "cpu", "allow_no_signal"))
    for bad in ("train.preflight.prompts=0", "train.eval.every=-1", "train.eval.problems=0"):
        with pytest.raises(RecipeError):
            validate(load_recipe(CPU_RECIPE, [bad]))
