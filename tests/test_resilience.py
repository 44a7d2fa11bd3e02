"""Never lose a run: complete checkpoints, resume, signals, kill -9, CUDA OOM (injected), a full disk, reward faults.

The fault runs train the tiny model in-process through the CLI's `main` (exit code and log), with
tests/faults.py's injector passed in as a trainer callback; the signal and kill -9 runs are child processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lowmem_grpo.rundir import checkpoints
from lowmem_grpo.errors import RecipeError
from faults import parse_faults
from lowmem_grpo.recipe import Recipe, TrainConfig
from lowmem_grpo.recipe_io import apply_overrides, load_recipe
from lowmem_grpo.rewards.guard import RewardError, guard_reward
from resilience_helpers import (adapter_tensors, cli_inprocess, cli_popen, constructed, fault_run,  # noqa: F401
                                grpo_steps, metrics, needs_cpu_determinism, one_torch_thread, tiny_args)

# --- checkpoints: markers, retention, rewind (no training) ------------------------------------------


def _fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        checkpoints.write_marker(folder, step)
    return folder


def test_a_checkpoint_counts_only_with_a_marker_matching_its_files(tmp_path):
    done = _fake_checkpoint(tmp_path, 2)
    partial = _fake_checkpoint(tmp_path, 4, complete=False)
    assert checkpoints.is_complete(done) and not checkpoints.is_complete(partial)
    assert checkpoints.last_complete(tmp_path) == (2, done)
    os.truncate(done / "adapter_model.safetensors", 50)  # cut short after the marker: no longer complete
    assert not checkpoints.is_complete(done)
    assert checkpoints.last_complete(tmp_path) is None


def test_rotation_deletes_old_checkpoints_only_once_a_newer_one_is_complete(tmp_path):
    for step in (2, 4):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 6, complete=False)  # being written (or killed mid-save)
    assert checkpoints.rotate(tmp_path, 1) == [2]
    assert [s for s, _ in checkpoints.checkpoint_dirs(tmp_path)] == [4, 6]  # 4 stays: 6 is not complete
    checkpoints.write_marker(tmp_path / "checkpoint-6", 6)
    assert checkpoints.rotate(tmp_path, 1) == [4]
    assert checkpoints.last_complete(tmp_path)[0] == 6


def test_rewind_keeps_lines_up_to_the_checkpoint_and_prime_lines(tmp_path):
    lines = [{"stage": "prime", "step": s, "loss": 1.0} for s in (1, 2, 3)]
    lines += [{"stage": "grpo", "step": s, "reward": 0.1} for s in (1, 2, 3, 4, 5)]
    lines += [{"stage": "grpo", "step": 2, "train_runtime": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"stage": "gr')
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 3, 5)))
    checkpoints.rewind_logs(tmp_path, 3)
    kept = [(m["stage"], m["step"]) for m in metrics(tmp_path)]
    assert kept == [("prime", 1), ("prime", 2), ("prime", 3), ("grpo", 1), ("grpo", 2), ("grpo", 3)]
    assert [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 3]
    checkpoints.rewind_logs(tmp_path, None, keep_prime=True)  # no checkpoint, the primed adapter complete
    assert [(m["stage"], m["step"]) for m in metrics(tmp_path)] == [("prime", 1), ("prime", 2), ("prime", 3)]
    checkpoints.rewind_logs(tmp_path, None)  # no checkpoint: the run restarts, priming included
    assert metrics(tmp_path) == []


# --- test faults, OOM lowering, reward guard (no training) ----------------------------------------


def test_fault_specs_parse_and_bad_ones_name_the_spec():
    faults = parse_faults(["oom@3", "oom@2:update*9", "enospc@4", "sigint@4:save*2"])
    assert [(f.kind, f.step, f.phase, f.times) for f in faults] == [
        ("oom", 3, "generation", 1), ("oom", 2, "update", 9), ("enospc", 4, "save", 1), ("sigint", 4, "save", 2)]
    for bad in ("oom", "boom@3", "oom@3:save", "enospc@0"):
        with pytest.raises(RecipeError, match="test_faults"):
            parse_faults([bad])


def test_oom_halving_follows_the_documented_order():
    from lowmem_grpo.train.oom import lower

    recipe = Recipe(train=TrainConfig(num_generations=4, per_device_train_batch_size=8, max_completion_length=64))
    seen = []
    while (step := lower(recipe, use_planner=False)) is not None:
        seen.append((step.how, step.changes))
        recipe = step.recipe
    assert seen[0] == ("halving: generation batch", {"train.per_device_train_batch_size": (8, 4),
                                                     "train.gradient_accumulation_steps": (1, 2),
                                                     "train.steps_per_generation": (None, 1)})
    assert [how for how, _ in seen] == ["halving: generation batch", "halving: max_completion_length",
                                        "halving: max_completion_length", "halving: num_generations"]
    t = recipe.train  # the floor: groups of 2, 16 tokens; the generation batch must stay divisible by 2
    assert (t.num_generations, t.per_device_train_batch_size, t.max_completion_length) == (2, 2, 16)
    # the generation-batch step keeps the completions per optimizer step (8); halving num_generations halves them
    assert t.per_device_train_batch_size * t.gradient_accumulation_steps == 4


def test_auto_fit_and_the_oom_halving_lower_in_the_one_ladders_order():
    """With the batch knobs held (explicit for auto-fit; for the halving a generation batch of one group, which
    cannot halve), both lower the next knob of the ladder, max_completion_length, and keep num_generations."""
    from lowmem_grpo.memory.fit import auto_fit
    from lowmem_grpo.memory.ladder import LADDER
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.train.oom import lower_by_halving

    names = [knob.name for knob in LADDER]
    assert names[:4] == ["per_device_train_batch_size", "generation_batch_size", "max_completion_length",
                         "num_generations"]
    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), [
        "train.num_generations=4", "train.per_device_train_batch_size=4", "train.steps_per_generation=1",
        "train.gradient_accumulation_steps=1", "train.max_completion_length=1024", "model.max_seq_length=1280"])
    shorter = apply_overrides(recipe, ["train.max_completion_length=512"])
    budget = (plan(recipe).total_bytes + plan(shorter).total_bytes) // 2
    fitted, fitted_plan = auto_fit(recipe, budget, {"train.per_device_train_batch_size", "train.steps_per_generation"})
    halved = lower_by_halving(recipe)
    assert fitted_plan.fits and halved.how == "halving: max_completion_length"
    for lowered in (fitted, halved.recipe):
        assert 512 <= lowered.train.max_completion_length < 1024
        assert (lowered.train.num_generations, lowered.train.per_device_train_batch_size) == (4, 4)


def _kwargs(n: int, step: int = 1) -> dict:
    return {"prompts": [f"p{i}" for i in range(n)], "completions": [f"c{i}" for i in range(n)],
            "question": [f"question {i}" for i in range(n)], "answer": [str(i) for i in range(n)],
            "trainer_state": SimpleNamespace(global_step=step - 1)}


def test_guard_names_function_step_and_example_of_a_raise():
    def picky(completions, answer, **kw):
        return [1 / (int(a) - 2) for a in answer]  # ZeroDivisionError on the example with gold 2

    guarded = guard_reward(picky)
    assert guarded.__name__ == "picky"
    with pytest.raises(RewardError) as err:
        guarded(**_kwargs(4, step=7))
    text = str(err.value)
    assert "'picky' raised ZeroDivisionError" in text and "step 7" in text
    assert "example 2 of 4" in text and "question 2" in text and "c2" in text
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_guard_passes_none_and_rejects_nan_wrong_length_and_text():
    assert guard_reward(lambda completions, **kw: [None, 1.0, 0])(**_kwargs(3)) == [None, 1.0, 0]
    none_all = guard_reward(lambda completions, **kw: None)
    assert none_all(**_kwargs(3)) == [None, None, None]  # skip every completion, as TRL reads None

    def nan(completions, **kw):
        return [0.0, math.nan, 0.0]

    def short(completions, **kw):
        return [0.0]

    def words(completions, **kw):
        return ["high", 0.0, 0.0]

    for func, expected in ((nan, "nan is not finite"), (short, "returned 1 scores for 3 completions"),
                           (words, "str 'high' is not a number")):
        with pytest.raises(RewardError, match=expected) as err:
            guard_reward(func)(**_kwargs(3, step=5))
        assert repr(func.__name__) in str(err.value) and "step 5" in str(err.value)


# --- faults during real (tiny) training runs, in-process -----------------------------------------


@pytest.mark.slow
def test_sigint_finishes_the_step_writes_a_checkpoint_and_resume_continues(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, steps=3, save_steps=10), faults=['sigint@1'])
    assert code == 130, log[-2000:]
    assert "interrupted by SIGINT: stopped after step 1 of 3" in log and "--resume" in log
    assert checkpoints.last_complete(run)[0] == 1  # save_steps=10: this checkpoint is the interrupt's
    assert (run / "report.md").exists() and not (run / "adapter").exists()
    assert grpo_steps(run) == [1]

    assert "test_faults" not in (run / "recipe.yaml").read_text()  # the resumed run goes on undisturbed
    code, log = cli_inprocess("train", "--resume", str(run))
    assert code == 0, log[-2000:]
    assert grpo_steps(run) == [1, 2, 3]
    assert (run / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_second_sigint_while_saving_aborts_and_keeps_the_last_complete_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, steps=3, save_steps=1), faults=['sigint@2:save*2'])
    assert code == 130, log[-2000:]
    assert "second signal (SIGINT): aborting at once" in log
    assert "last complete checkpoint: checkpoint-1 (step 1)" in log
    assert (run / "checkpoint-2").is_dir() and not checkpoints.is_complete(run / "checkpoint-2")
    assert checkpoints.is_complete(run / "checkpoint-1")
    point = checkpoints.resume_point(run, 3)
    assert point.step == 1 and not point.finished


@pytest.mark.slow
def test_an_oom_resumes_the_run_in_a_fresh_process_with_lowered_settings(tiny_model_dir, tmp_path):
    """An OOM at step 2 writes the lowered settings into recipe.yaml and oom_retries.jsonl, and the process replaces
    itself with `train --resume`: the fresh process continues from checkpoint-1 with them. Each process builds one
    Runtime and one GRPO trainer (the first also priming's SFT trainer); the test's fault injector is gone with the
    first process."""
    run, counts = tmp_path / "run", tmp_path / "constructions.jsonl"
    done = fault_run("oom@2", *tiny_args(tiny_model_dir, run, steps=3, save_steps=1), constructions=counts)
    log = done.stdout
    assert done.returncode == 0, log[-3000:]
    first, _, fresh = log.partition("continuing in a fresh process: -m lowmem_grpo.cli train --resume")
    assert "CUDA out of memory at step 2 (generation)" in first and "OOM retry 1 of 2" in first, log[-3000:]
    assert f"resuming {run} from checkpoint-1 (step 1)" in fresh and "done: adapter in" in fresh, log[-3000:]
    assert constructed(counts) == [{"Runtime": 1, "CpuSafeSFTTrainer": 1, "CpuSafeGRPOTrainer": 1},
                                   {"Runtime": 1, "CpuSafeGRPOTrainer": 1}]
    retries = [json.loads(x) for x in (run / "oom_retries.jsonl").read_text().splitlines()]
    assert len(retries) == 1 and retries[0]["step"] == 2 and retries[0]["resumed_from"] == "checkpoint-1"
    assert retries[0]["changes"]["train.per_device_train_batch_size"] == [8, 4], retries  # the generation batch
    text = (run / "recipe.yaml").read_text()
    assert text.startswith("# lowmem-grpo: CUDA out of memory at step 2 (generation), retry 1")
    saved = yaml.safe_load(text)
    for key, (old, new) in retries[0]["changes"].items():
        section, name = key.split(".", 1)
        assert saved[section][name] == new != old
    assert grpo_steps(run) == [1, 2, 3]  # step 2's failed attempt left no line
    assert [m["step"] for m in metrics(run) if m.get("stage") == "prime" and "loss" in m] == list(range(1, 21))
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    report = (run / "report.md").read_text()
    assert "- CUDA out of memory at step 2 (generation, " in report and "continued from checkpoint-1" in report


@pytest.mark.slow
@needs_cpu_determinism
def test_an_oom_before_any_checkpoint_ends_as_an_uninterrupted_run_with_the_lowered_settings(tiny_model_dir,
                                                                                              tmp_path):
    """An OOM in step 1: the fresh process keeps the complete primed adapter and trains GRPO from step 0 with the
    lowered settings, ending with the adapter, bit for bit, of a run started with them (its recipe.yaml)."""
    run, clean, counts = tmp_path / "run", tmp_path / "clean", tmp_path / "constructions.jsonl"
    done = fault_run("oom@1", *tiny_args(tiny_model_dir, run, steps=2, save_steps=2), constructions=counts)
    assert done.returncode == 0 and "priming: " in done.stdout and "is complete, loaded" in done.stdout, \
        done.stdout[-3000:]
    assert constructed(counts)[1] == {"Runtime": 1, "CpuSafeGRPOTrainer": 1}  # priming is not repeated
    code, log = cli_inprocess("train", str(run / "recipe.yaml"), f"output.dir={clean}")
    assert code == 0, log[-3000:]
    a, b = adapter_tensors(run / "adapter"), adapter_tensors(clean / "adapter")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert [m["reward"] for m in metrics(run) if "reward" in m] == [m["reward"] for m in metrics(clean) if "reward" in m]


def test_oom_retries_used_up_stop_with_what_was_tried(tmp_path):
    from lowmem_grpo.errors import OutOfMemoryError, ResumeAfterOom
    from lowmem_grpo.train.oom import resume_with_lowered

    recipe = apply_overrides(Recipe(), ["train.memory.oom_retries=1", "model.name=no-such-model"])  # halving
    (tmp_path / "recipe.yaml").write_text("name: run\n")
    first = resume_with_lowered(tmp_path, recipe, 1, "update", "OutOfMemoryError: CUDA out of memory")
    assert isinstance(first, ResumeAfterOom) and first.run_dir == tmp_path
    # one group per generation batch (8 x 8) cannot halve: the completion length goes first
    assert "OOM retry 1 of 1: train.max_completion_length 256 -> 128 (halving" in str(first)
    assert "continues from step 0" in str(first)
    assert (tmp_path / "recipe.yaml").read_text().startswith("# lowmem-grpo: CUDA out of memory at step 1 (update)")
    stop = resume_with_lowered(tmp_path, recipe, 1, "update", "OutOfMemoryError: CUDA out of memory")
    assert type(stop) is OutOfMemoryError and stop.exit_code == 1
    assert ("CUDA out of memory at step 1 (update) and train.memory.oom_retries=1 is used up; tried: retry 1 at step 1: "
            "train.max_completion_length 256 -> 128") in str(stop)
    assert "last complete checkpoint: none" in str(stop) and "--resume" in stop.fix
    assert len((tmp_path / "oom_retries.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint_leaves_none_that_looks_complete(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, steps=3, save_steps=1), faults=['enospc@2'])
    assert code == 2, log[-3000:]
    assert "disk full while writing the run at step 2" in log and "No space left on device" in log
    assert "removed the incomplete checkpoint-2" in log and "last complete checkpoint: checkpoint-1 (step 1)" in log
    assert [s for s, _ in checkpoints.checkpoint_dirs(run)] == [1] and checkpoints.is_complete(run / "checkpoint-1")
    assert checkpoints.resume_point(run, 3).step == 1


@pytest.mark.slow
def test_reward_that_raises_names_function_step_and_example(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    rewards = "rewards={'lowmem_fault_rewards:raising_reward': 1.0, 'lowmem_test_rewards:length_reward': 1.0}"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, rewards, steps=2, save_steps=1))
    assert code == 1, log[-3000:]
    assert "reward function 'raising_reward' raised ValueError: cannot score gold" in log
    assert "at step 2, on example 0 of 8: question '" in log and "--resume" in log
    assert checkpoints.last_complete(run)[0] == 1 and grpo_steps(run) == [1]


@pytest.mark.slow
def test_reward_nan_is_rejected_and_none_is_skipped(tiny_model_dir, tmp_path):
    nan = "rewards={'lowmem_fault_rewards:nan_reward': 1.0, 'lowmem_test_rewards:length_reward': 1.0}"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, tmp_path / "nan", nan, steps=1))
    assert code == 1 and "'nan_reward' returned nan is not finite at step 1, on example 1 of" in log, log[-2000:]

    none = "rewards={'lowmem_fault_rewards:half_none_reward': 1.0, 'lowmem_test_rewards:length_reward': 1.0}"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, tmp_path / "none", none, steps=1, save_steps=1))
    assert code == 0, log[-2000:]
    assert all(math.isfinite(m["reward"]) for m in metrics(tmp_path / "none") if "reward" in m)


# --- real signals and kill -9 on child processes ---------------------------------------------------


def _wait_for(predicate, proc, timeout: float = 240.0, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(poll)


@pytest.mark.slow
def test_sigterm_from_outside_exits_143_with_a_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = cli_popen(*tiny_args(tiny_model_dir, run, steps=200, save_steps=100))
    _wait_for(lambda: bool(grpo_steps(run)), proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 143, out[-3000:]
    step = checkpoints.last_complete(run)[0]
    assert "interrupted by SIGTERM" in out and grpo_steps(run) == list(range(1, step + 1))


@pytest.mark.slow
@needs_cpu_determinism
def test_three_kill9_and_resume_cycles_match_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """kill -9 as soon as a new checkpoint is complete (the run is then rotating old ones or inside the next
    step), three times; each resume starts from the last complete checkpoint. The hf backend on CPU is
    deterministic, LoRA is initialised from train.seed and a checkpoint restores the RNG states, so the final
    adapter must equal the uninterrupted run's exactly (tolerance 0), and so must every logged reward."""
    steps = 5
    run, reference = tmp_path / "killed", tmp_path / "reference"
    kills = []
    for cycle in range(3):
        args = tiny_args(tiny_model_dir, run, steps=steps, save_steps=1) if cycle == 0 else \
            ["train", "--resume", str(run)]
        before = (checkpoints.last_complete(run) or (0, None))[0]
        proc = cli_popen(*args)
        _wait_for(lambda: (checkpoints.last_complete(run) or (0, None))[0] > before, proc, poll=0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        kills.append(checkpoints.last_complete(run)[0])
        found = grpo_steps(run)
        assert found == sorted(set(found)), f"steps out of order after kill {cycle + 1}: {found}"
    assert kills == sorted(set(kills)) and kills[-1] < steps, kills
    proc = cli_popen("train", "--resume", str(run))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert grpo_steps(run) == list(range(1, steps + 1))  # strictly increasing, none missing

    code, log = cli_inprocess(*tiny_args(tiny_model_dir, reference, steps=steps, save_steps=1))  # same seeds
    assert code == 0, log[-3000:]
    a, b = adapter_tensors(run / "adapter"), adapter_tensors(reference / "adapter")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    ours = [m["reward"] for m in metrics(run) if "reward" in m]
    assert ours == [m["reward"] for m in metrics(reference) if "reward" in m]

    # a kill -9 while adapter/ was written: resume rewrites it from the final checkpoint, training no extra step
    os.truncate(run / "adapter" / "adapter_model.safetensors", 1000)
    code, log = cli_inprocess("train", "--resume", str(run))
    assert code == 0 and f"checkpoint-{steps} is the final step" in log, log[-2000:]
    a = adapter_tensors(run / "adapter")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0 and grpo_steps(run) == list(range(1, steps + 1))
    code, log = cli_inprocess("train", "--resume", str(run))
    assert code == 0 and "already finished" in log
