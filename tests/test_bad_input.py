"""Bad input: each case exits 2 with a message naming the problem and its fix, and writes nothing but the log.

All run `lowmem-grpo train` in-process (cli.main) on the tiny model; the run directory is a fresh path
that must still not exist afterwards (or, for a folder holding another run, be left byte for byte).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from resilience_helpers import CPU_RECIPE, cli_inprocess, one_torch_thread, tiny_args, tree  # noqa: F401


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(model_dir: Path, run: Path, *extra: str) -> tuple[int, str]:
    return cli_inprocess(*tiny_args(model_dir, run, *extra, steps=1))


def test_missing_recipe_file(tmp_path):
    code, log = cli_inprocess("train", str(tmp_path / "nope.py"), f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "nope.py' does not exist" in log and "fix:" in log
    assert not (tmp_path / "run").exists()


def test_syntax_error_in_recipe_module(tmp_path):
    module = tmp_path / "broken.py"
    module.write_text("from lowmem_grpo.recipe import Recipe\n\ndef recipe(:\n    return Recipe()\n")
    code, log = cli_inprocess("train", str(module), f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "broken.py:3: syntax error in recipe module" in log and "fix the Python syntax" in log
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, expected", [
    ("lora.alpah=4", "unknown key 'lora.alpah'"),
    ("train.max_stepz=5", "unknown key 'train.max_stepz'"),
])
def test_unknown_key_names_it_with_a_did_you_mean(tiny_model_dir, tmp_path, override, expected):
    code, log = _train(tiny_model_dir, tmp_path / "run", override)
    assert code == 2 and expected in log and "did you mean" in log
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, expected", [
    ("lora.r=abc", "lora.r: expected int, got str 'abc'"),
    ("train.memory.oom_retries=-1", "train.memory.oom_retries: is -1"),
    ("train.test_faults=[oom@x]", "unknown key 'train.test_faults'"),  # fault injection is no recipe field
])
def test_wrong_type_or_value(tiny_model_dir, tmp_path, override, expected):
    code, log = _train(tiny_model_dir, tmp_path / "run", override)
    assert code == 2 and expected in log and "fix:" in log
    assert not (tmp_path / "run").exists()


def test_dataset_path_missing(tiny_model_dir, tmp_path):
    code, log = _train(tiny_model_dir, tmp_path / "run", f"data.source={tmp_path / 'missing.jsonl'}")
    assert code == 2 and "missing.jsonl': no such file or folder" in log
    assert not (tmp_path / "run").exists()


def test_dataset_without_question_answer_columns(tiny_model_dir, tmp_path):
    data = _jsonl(tmp_path / "qa.jsonl", [{"q": "How many?", "a": "#### 3"}])
    code, log = _train(tiny_model_dir, tmp_path / "run", f"data.source={data}")
    assert code == 2 and "missing column(s) question, answer; found q, a" in log
    assert not (tmp_path / "run").exists()


def test_gold_answers_without_the_marker(tiny_model_dir, tmp_path):
    data = _jsonl(tmp_path / "gold.jsonl", [{"question": "How many?", "answer": "three"}])
    code, log = _train(tiny_model_dir, tmp_path / "run", f"data.source={data}")
    assert code == 2 and "row 0" in log and "#### N" in log
    assert not (tmp_path / "run").exists()


def test_empty_dataset_after_prompt_length_filtering(tiny_model_dir, tmp_path):
    """Found only once the tokenizer is loaded, yet the run directory is created after this check."""
    code, log = _train(tiny_model_dir, tmp_path / "run", "data.max_prompt_length=8")
    assert code == 2 and "no prompt fits data.max_prompt_length=8 tokens" in log
    assert not (tmp_path / "run").exists()


def test_model_path_that_does_not_exist(tmp_path):
    run = tmp_path / "run"
    code, log = cli_inprocess(*tiny_args(tmp_path / "no-model", run, steps=1))
    assert code == 2 and "no-model'" in log and "no such folder" in log
    assert not run.exists()


def test_run_directory_not_writable(tiny_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, log = _train(tiny_model_dir, blocker / "run", )
    assert code == 2 and f"run directory {blocker / 'run'} is not writable" in log and "is a file" in log
    assert blocker.read_text() == "not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_run_directory_in_a_read_only_folder(tiny_model_dir, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, log = _train(tiny_model_dir, locked / "run")
    finally:
        locked.chmod(0o755)
    assert code == 2 and "is not writable" in log and list(locked.iterdir()) == []


def test_run_directory_holding_another_run_is_refused_and_left_alone(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: earlier\n")
    _jsonl(run / "metrics.jsonl", [{"stage": "grpo", "step": 1, "reward": 0.5}])
    before = tree(run)
    code, log = _train(tiny_model_dir, run)
    assert code == 2 and f"run directory {run} already holds a run (checkpoint-2, metrics.jsonl, recipe.yaml)" in log
    assert f"lowmem-grpo train --resume {run}" in log
    assert tree(run) == before


@pytest.mark.parametrize("args, expected", [
    (["train"], "train needs a RECIPE, or --resume RUN_DIR"),
    (["train", "--resume", "{tmp}/nothing-here"], "no such run directory"),
    (["train", "--resume", "{tmp}"], "holds no recipe.yaml, so it is not a run directory"),
    (["train", CPU_RECIPE, "--resume", "{tmp}"], "--resume continues"),
])
def test_resume_misuse(tmp_path, args, expected):
    before = tree(tmp_path)
    code, log = cli_inprocess(*[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and expected in log, log
    assert tree(tmp_path) == before


def test_a_reward_module_that_raises_on_import_is_named(tiny_model_dir, tmp_path):
    """Any exception while importing a `module:function` reward is bad input (exit 2) naming both, not a traceback."""
    code, log = _train(tiny_model_dir, tmp_path / "run", "rewards={'lowmem_broken_reward:score': 1.0}")
    assert code == 2, log[-2000:]
    assert "lowmem_broken_reward:score" in log and "RuntimeError: boom" in log
    assert not (tmp_path / "run").exists()


def test_eval_names_a_missing_model_before_the_data(tmp_path):
    """The hub dataset is not even asked for: the model is checked first."""
    missing = tmp_path / "no-such-model"
    code, log = cli_inprocess("eval", "--model", str(missing), "--data", "gsm8k", "--out", str(tmp_path / "out"),
                              "--no-progress")
    assert code == 2 and str(missing) in log and "no such folder" in log, log[-2000:]
    assert "gsm8k" not in log.split(str(missing))[0]  # nothing about the dataset before the model


def test_known_third_party_startup_noise_is_silenced():
    """torchao's pytree deprecation lines (one per enum, at import) no longer open the first screen."""
    import subprocess
    import sys

    # an extra train key makes validate import TRL (and with it torchao) to check it against GRPOConfig
    done = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "validate", CPU_RECIPE, "train.top_p=0.95"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "_pytree" not in done.stderr and "register_constant" not in done.stderr, done.stderr[:2000]
