"""benchmarks/cpu_speed.py step: its spec is the CPU default recipe, it refuses to compare sides whose configurations
differ, and each command its docstring gives runs (--check-only)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_run import cpu_runtime

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_speed.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("cpu_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing heavy: the workers do
    return module


STEP_CPU = _load_script()


def _as_checked(index: int, args: list[str]) -> list[str]:
    """The first command that names the real model runs with it (its tokenizer decides the completion budget); the
    others, which differ from it in the environment only, run on the tiny model."""
    first_real = next(i for i, (_, a) in enumerate(STEP_CPU.documented_commands()) if "smollm2" in a)
    return args if index == first_real else [a.replace("smollm2", "tiny") for a in args]


DOCUMENTED = [pytest.param(env, _as_checked(i, args),
                           id=" ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(args))
              for i, (env, args) in enumerate(STEP_CPU.documented_commands())]


@pytest.fixture(scope="module")
def step_cpu():
    return STEP_CPU


FINGERPRINT = {
    "trainer_class": "CpuSafeGRPOTrainer",
    "grpo": {"learning_rate": 1e-4, "num_generations": 4, "bf16": False, "seed": 42},
    "lora": {"r": 16, "lora_alpha": 32, "target_modules": ["k_proj", "q_proj"]},
    "param_dtypes": ["torch.float32"],
    "prompts_sha": "aaaa", "lora_init_sha": "bbbb",
    "rewards": [["correctness", 2.0], ["xml_count", 0.5]],
}


def test_identical_fingerprints_pass(step_cpu, capsys):
    step_cpu.check_same(FINGERPRINT, copy.deepcopy(FINGERPRINT), "tiny float32")
    out = capsys.readouterr().out
    assert "config tiny float32 lowmem:" in out and "config tiny float32 plain:" in out  # both printed
    assert "identical on both sides" in out


def test_differing_fingerprints_fail_loudly_naming_the_keys(step_cpu, capsys):
    plain = copy.deepcopy(FINGERPRINT)
    plain["grpo"]["learning_rate"] = 5e-6
    plain["param_dtypes"] = ["torch.bfloat16"]
    plain["lora_init_sha"] = "cccc"
    assert step_cpu.compare(FINGERPRINT, plain) == [
        "grpo.learning_rate: lowmem=0.0001 plain=5e-06",
        "lora_init_sha: lowmem='bbbb' plain='cccc'",
        "param_dtypes: lowmem=['torch.float32'] plain=['torch.bfloat16']",
    ]
    with pytest.raises(SystemExit) as stopped:
        step_cpu.check_same(FINGERPRINT, plain, "tiny float32")
    assert stopped.value.code not in (0, None)  # a message: exit status 1
    assert "grpo.learning_rate" in str(stopped.value) and "lora_init_sha" in str(stopped.value)
    captured = capsys.readouterr()
    assert "NOT LIKE FOR LIKE (tiny float32)" in captured.err and "param_dtypes" in captured.err


def test_a_key_only_one_side_has_is_a_difference(step_cpu):
    plain = copy.deepcopy(FINGERPRINT)
    del plain["rewards"]
    plain["grpo"]["beta"] = 0.04
    assert step_cpu.compare(FINGERPRINT, plain) == ["grpo.beta: lowmem=None plain=0.04",
                                                    "rewards: lowmem=[['correctness', 2.0], ['xml_count', 0.5]] plain=None"]


def test_documented_commands_include_the_cpu_defaults_own_shape(step_cpu):
    commands = step_cpu.documented_commands()
    assert len(commands) >= 2
    assert ({"OMP_NUM_THREADS": "2"}, ["--models", "smollm2", "--steps", "6", "--repeats", "2"]) in commands
    assert any("tiny" in args for _, args in commands)


def test_the_spec_is_the_cpu_default_recipe_itself(step_cpu, tmp_path):
    from lowmem_grpo.recipe import CpuConfig
    from lowmem_grpo.recipe_io import load_recipe

    shipped = load_recipe(step_cpu.RECIPE)
    spec = {"model": "smollm2", "dtype": "auto", "steps": 6, "before": step_cpu.BEFORE, "start_adapter": None}
    sides = {side: load_recipe(step_cpu.RECIPE, step_cpu.side_overrides(spec, side, "/models/m", tmp_path))
             for side in ("plain", "before", "after")}
    changed = {"max_steps", "preflight", "eval"}  # what a step benchmark leaves out
    for recipe in sides.values():
        assert recipe.data == shipped.data and recipe.lora == shipped.lora and recipe.rewards == shipped.rewards
        assert recipe.model.dtype == shipped.model.dtype == "auto" and recipe.prime.enabled is False
        assert not recipe.train.preflight.enabled and not recipe.train.eval.stage.problems
        for name in vars(shipped.train):
            if name not in changed and name != "cpu":
                assert getattr(recipe.train, name) == getattr(shipped.train, name), name
    assert shipped.data.source == "generated" and shipped.train.max_completion_length == 64
    assert sides["after"].train.cpu.fast is True and sides["plain"].train.cpu.fast is True
    assert sides["before"].train.cpu.fast is False  # the switch "before" turns off, and nothing else
    assert dataclasses.replace(sides["before"].train, cpu=CpuConfig(fast=True)) == sides["after"].train


def test_the_plain_side_sets_every_grpo_config_field_ours_sets(step_cpu, tmp_path):
    from trl import GRPOConfig

    from lowmem_grpo.recipe import resolved_rewards
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.grpo import build_grpo_config

    recipe = load_recipe(step_cpu.RECIPE, ["train.max_steps=6"])
    weights = list(resolved_rewards(recipe).values())
    ours = build_grpo_config(recipe, tmp_path, cpu_runtime(recipe).loaded("bfloat16"), reward_weights=weights).to_dict()
    plain = GRPOConfig(output_dir=str(tmp_path), save_strategy="steps", use_cpu=True, disable_tqdm=True,
                       reward_weights=weights, **step_cpu.plain_grpo_values(recipe)).to_dict()
    assert ours["mask_truncated_completions"] is True and ours["scale_rewards"] == "batch" and ours["beta"] == 0.04
    assert step_cpu.compare({"grpo": ours}, {"grpo": plain}) == []


def test_the_pinned_run_uses_the_packages_threshold(step_cpu):
    from lowmem_grpo.rundir.rss import MMAP_THRESHOLD

    assert step_cpu.PINNED_MALLOC == {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def _check_only(step_cpu, env: dict[str, str], args: list[str], work: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "step", *args, "--check-only", "--work", str(work)]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize(("env", "args"), DOCUMENTED)
def test_each_documented_command_runs_its_check_only_path(step_cpu, env, args, tmp_path):
    """The budget check (ours runs it before loading), priming, and every side's fingerprint, for each command the
    docstring gives (the real model once: _as_checked)."""
    done = _check_only(step_cpu, env, args, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    dtypes = args[args.index("--dtypes") + 1].split(",") if "--dtypes" in args else ["auto"]
    assert done.stdout.count(": like for like") == len(dtypes)
    assert '"sampling_engine": false, "shared_prompt": false' in done.stdout  # plain: TRL + PEFT as they are
    assert 'after: lowmem_grpo\'s switches live: {"cpu_attention": true, "merged_sampling": true, ' \
           '"sampling_engine": true' in done.stdout
    model = args[args.index("--models") + 1]
    if env.get("LOWMEM_GRPO_CPU_DTYPE") == "float32":  # what model.dtype=auto resolves to, on every side
        assert f"check-only {model} torch.float32 (4 prompts x 8 x 64 tokens" in done.stdout


@pytest.mark.slow
def test_check_only_refuses_a_budget_the_solutions_do_not_fit(step_cpu, tmp_path):
    done = _check_only(step_cpu, {"OMP_NUM_THREADS": "1"}, ["--models", "tiny", "--dtypes", "float32",
                                                            "--set", "train.max_completion_length=8"], tmp_path)
    assert done.returncode != 0
    assert "train.max_completion_length=8: " in done.stderr and "cannot finish in the answer format" in done.stderr


@pytest.mark.slow
def test_check_only_stops_when_a_side_is_not_like_for_like(step_cpu, tmp_path):
    done = _check_only(step_cpu, {"OMP_NUM_THREADS": "1"}, ["--models", "tiny", "--dtypes", "float32", "--start",
                                                            "fresh", "--before", "train.temperature=1.0"], tmp_path)
    assert done.returncode == 1
    assert "NOT LIKE FOR LIKE" in done.stderr and "grpo.temperature: lowmem=1.0 plain=0.7" in done.stderr
