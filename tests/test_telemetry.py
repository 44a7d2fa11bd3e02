"""Run telemetry: metrics.jsonl keys, completions.jsonl content, health warnings, report_to pass-through."""

from __future__ import annotations

import json
import os
import logging
from pathlib import Path

import pytest

from tiny_run import cpu_runtime, train_tiny

REWARD_WEIGHTS = {"correctness": 2.0, "length_reward": 1.0}


def healthy(step: int, **changes) -> dict:
    record = {"stage": "grpo", "step": step, "loss": 0.01, "grad_norm": 0.3, "learning_rate": 1e-5, "reward": 0.8,
              "reward_std": 0.4, "frac_reward_zero_std": 0.25, "completions/mean_length": 80.0,
              "completions/clipped_ratio": 0.1, "rewards/correctness/mean": 0.3}
    record.update(changes)
    return record


# ---- warnings: a pure function over metric records -------------------------------------------------

def test_no_warning_on_healthy_metrics():
    from lowmem_grpo.rundir.health import check, scan

    records = [healthy(s) for s in range(1, 11)] + [{"stage": "grpo", "step": 10, "train_runtime": 5.0}]
    assert check(records) == [] and scan(records) == []
    assert check([]) == []


def test_reward_std_zero_fires_after_three_steps_only():
    from lowmem_grpo.rundir.health import check

    records = [healthy(1), healthy(2, reward_std=0.0), healthy(3, reward_std=0.0)]
    assert check(records) == []
    records.append(healthy(4, reward_std=0.0))
    (warning,) = check(records)
    assert warning.code == "reward_std_zero" and warning.step == 4
    assert "no gradient" in warning.message and "data.prefill" in warning.fix
    assert check(records + [healthy(5)]) == []


@pytest.mark.parametrize("frac,fires", [(0.9, False), (0.95, True), (1.0, True)])
def test_frac_reward_zero_std_above_0_9(frac, fires):
    from lowmem_grpo.rundir.health import check

    codes = [w.code for w in check([healthy(1, frac_reward_zero_std=frac)])]
    assert codes == (["frac_reward_zero_std"] if fires else [])


@pytest.mark.parametrize("ratio,fires", [(0.5, False), (0.51, True), (1.0, True)])
def test_clipped_ratio_above_half_suggests_longer_completions_or_length_reward(ratio, fires):
    from lowmem_grpo.rundir.health import check

    warnings = check([healthy(1, **{"completions/clipped_ratio": ratio})])
    assert [w.code for w in warnings] == (["clipped_ratio"] if fires else [])
    if fires:
        assert "max_completion_length" in warnings[0].fix and "length reward" in warnings[0].fix


@pytest.mark.parametrize("value", [float("nan"), None, float("inf")])
def test_nan_grad_norm(value):
    from lowmem_grpo.rundir.health import check

    (warning,) = check([healthy(1), healthy(2, grad_norm=value)])
    assert warning.code == "grad_norm_nan" and warning.step == 2


def test_grad_norm_nan_read_back_from_metrics_jsonl(tmp_path):
    from lowmem_grpo.rundir.health import check
    from lowmem_grpo.rundir.telemetry import append_jsonl, read_metrics

    append_jsonl(tmp_path / "metrics.jsonl", healthy(1, grad_norm=float("nan")))
    assert [w.code for w in check(read_metrics(tmp_path))] == ["grad_norm_nan"]


def test_scan_and_latch_report_each_warning_when_it_starts():
    from lowmem_grpo.rundir.health import WarningLatch, scan

    records = [healthy(1), healthy(2, frac_reward_zero_std=1.0), healthy(3, frac_reward_zero_std=1.0), healthy(4),
               healthy(5, frac_reward_zero_std=1.0)]
    assert [(w.code, w.step) for w in scan(records)] == [("frac_reward_zero_std", 2), ("frac_reward_zero_std", 5)]
    latch = WarningLatch()
    fired = [[w.step for w in latch.update(records[:end])] for end in range(1, 6)]
    assert fired == [[], [2], [], [], [5]]


# ---- completions.jsonl: wrapped reward functions ---------------------------------------------------

def _trend(goal: list[float], total: list[float]) -> list[dict]:
    return [healthy(i + 1, reward=t, **{"rewards/correctness/mean": g}) for i, (g, t) in enumerate(zip(goal, total))]


def test_goal_reward_falling_while_the_total_rises_warns_of_reward_hacking():
    from lowmem_grpo.rundir.health import check, scan

    # the measured failure: correctness 0.31 -> 0, format rewards up to 1.0, the total rising
    hacked = _trend([0.31, 0.25, 0.2, 0.12, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0],
                    [1.2, 1.4, 1.5, 1.7, 1.8, 1.9, 2.0, 2.0, 2.0, 2.0])
    assert check(hacked) == []  # no goal named: nothing to judge
    (warning,) = check(hacked, goal="correctness")
    assert warning.code == "reward_hacking" and warning.step == 10
    assert "correctness fell from" in warning.message and "train.beta" in warning.fix
    assert check(hacked[:5], goal="correctness") == []  # too few steps to call a trend
    assert [w.code for w in scan(hacked, goal="correctness")] == ["reward_hacking"]
    # both rising, or both falling: no warning
    for goal, total in (([0.1 * i for i in range(10)], [1 + 0.1 * i for i in range(10)]),
                        ([0.3 - 0.03 * i for i in range(10)], [2 - 0.1 * i for i in range(10)])):
        assert check(_trend(goal, total), goal="correctness") == []


def test_the_total_rising_while_the_goal_stays_flat_warns_of_credit_without_answers():
    from lowmem_grpo.rundir.health import check, scan

    # partial credit (chain_steps) climbing while correctness stays where it was
    paid = _trend([0.3, 0.32, 0.3, 0.31, 0.3, 0.3, 0.29, 0.31, 0.3, 0.3],
                  [0.6, 0.62, 0.65, 0.7, 0.72, 0.8, 0.82, 0.85, 0.9, 0.9])
    (warning,) = check(paid, goal="correctness")
    assert warning.code == "credit_without_goal" and "did not (0.31 -> 0.30" in warning.message
    assert "chain_steps" in warning.message and "lower" in warning.fix
    assert [w.code for w in scan(paid, goal="correctness")] == ["credit_without_goal"]
    assert check(paid, goal=None) == []
    # the goal rising with the total, or the total rising less than the threshold: no warning
    rising = _trend([0.3 + 0.02 * i for i in range(10)], [0.6 + 0.04 * i for i in range(10)])
    small = _trend([0.3] * 10, [0.6, 0.61, 0.62, 0.63, 0.64, 0.65, 0.66, 0.67, 0.68, 0.69])
    assert check(rising, goal="correctness") == [] and check(small, goal="correctness") == []


def _collapse(step: int, distinct: float | None, shared: float | None) -> dict:
    stats = {k: v for k, v in (("completions/distinct_answers", distinct),
                               ("completions/shared_across_prompts", shared)) if v is not None}
    return healthy(step, **stats)


def test_template_collapse_fires_on_alike_answers_or_shared_completions_over_three_steps():
    from lowmem_grpo.rundir.health import check

    fine = [_collapse(s, 1.0, 0.0) for s in range(1, 5)]
    assert check(fine) == []
    same_answer = fine + [_collapse(s, 0.5, 0.0) for s in range(5, 8)]
    (warning,) = check(same_answer)
    assert warning.code == "template_collapse" and "train.beta" in warning.fix
    assert "distinct answers per distinct correct answer 0.50" in warning.message
    assert check(fine + [_collapse(5, 0.5, 0.0), _collapse(6, 0.5, 0.0)]) == []  # two steps are not a trend
    assert check(fine + [_collapse(5, 0.5, 0.0), _collapse(6, 1.0, 0.0), _collapse(7, 0.5, 0.0)]) == []
    same_text = fine + [_collapse(s, None, 0.5) for s in range(5, 8)]
    assert [w.code for w in check(same_text)] == ["template_collapse"]
    assert check(fine + [_collapse(s, None, 0.1) for s in range(5, 8)]) == []


def test_collapse_stats_from_a_batch_of_completions():
    from lowmem_grpo.rundir.completions import collapse_stats

    template = "Then it has 4+2=6.\n</reasoning>\n<answer>\n6\n</answer>"
    prompts = ["p1"] * 4 + ["p2"] * 4 + ["p3"] * 4
    collapsed = collapse_stats(prompts, [template] * 12, golds=["6"] * 4 + ["9"] * 4 + ["11"] * 4)
    assert collapsed == {"completions/distinct_answers": pytest.approx(1 / 3),
                         "completions/shared_across_prompts": 1.0}
    varied = [f"{a}+1={a + 1}.\n</reasoning>\n<answer>\n{a + 1}\n</answer>" for a in (5, 5, 5, 4, 8, 8, 7, 8, 10, 10,
                                                                                       10, 3)]
    healthy_stats = collapse_stats(prompts, varied, golds=["6"] * 4 + ["9"] * 4 + ["11"] * 4)
    assert healthy_stats == {"completions/distinct_answers": 1.0, "completions/shared_across_prompts": 0.0}
    # the same answer to prompts whose correct answers are the same is no collapse
    same_gold = collapse_stats(["a"] * 2 + ["b"] * 2, ["<answer>\n6\n</answer>"] * 4, golds=["6"] * 4)
    assert "completions/distinct_answers" not in same_gold
    assert collapse_stats(["a"] * 4, [template] * 4) == {}  # one prompt: nothing to compare


def test_should_record_first_every_nth_and_last():
    from lowmem_grpo.rundir.completions import should_record

    assert [s for s in range(1, 26) if should_record(s, 10, 25)] == [1, 10, 20, 25]
    assert not any(should_record(s, 0, 25) for s in range(1, 26))


def test_wrapper_keeps_name_and_scores():
    from lowmem_grpo.rundir.completions import CompletionRecorder
    from lowmem_test_rewards import length_reward

    recorder = CompletionRecorder(Path("unused"), 10, {"length_reward": 1.0})
    wrapped = recorder.wrap(length_reward)
    assert wrapped.__name__ == "length_reward"
    assert wrapped(["ab", "abcd"]) == length_reward(["ab", "abcd"])
    assert recorder.pending == []  # no trainer_state: nothing to record


# ---- a tiny run --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """4 steps, completions every 3 steps (so steps 1, 3 and the last, 4), 16-token completions (all clipped)."""
    return train_tiny(tiny_model_dir, tmp_path_factory.mktemp("telemetry") / "run", "train.max_steps=4",
                      "train.completions_every=3", "train.save_steps=10", "train.num_generations=4")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_metrics_jsonl_has_every_trainer_key(tiny_run):
    run_dir, _ = tiny_run
    records = lines(run_dir / "metrics.jsonl")
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    keys = {"stage", "step", "loss", "grad_norm", "learning_rate", "num_tokens", "reward", "reward_std",
            "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "entropy", "step_time",
            "rewards/correctness/mean", "rewards/correctness/std", "rewards/length_reward/mean",
            "completions/shared_across_prompts", "optimizer/skipped_no_signal"}  # every step, recorded or not
    for record in steps:
        assert keys <= set(record), keys - set(record)
        assert record["stage"] == "grpo"
        assert 0.0 <= record["completions/shared_across_prompts"] <= 1.0
        assert record["optimizer/skipped_no_signal"] in (0.0, 1.0)
    assert "train_runtime" in records[-1]
    env = json.loads((run_dir / "env.json").read_text())
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the recipe names hf; the device is this machine's
    assert env["backend"] == "hf" and env["device"] == device and env["packages"]["trl"]


@pytest.mark.slow
def test_completions_jsonl_holds_prompts_answers_and_each_rewards_score(tiny_run):
    from lowmem_grpo.rewards import get_reward
    from lowmem_test_rewards import length_reward

    run_dir, _ = tiny_run
    rows = lines(run_dir / "completions.jsonl")
    assert sorted({r["step"] for r in rows}) == [1, 3, 4]
    correctness = get_reward("correctness")
    metrics = {r["step"]: r for r in lines(run_dir / "metrics.jsonl") if "reward" in r}
    for step in (1, 3, 4):
        groups = [r for r in rows if r["step"] == step]
        assert len(groups) == 2  # 8 completions per step in groups of num_generations=4
        scores = []
        for group in groups:
            assert group["question"] in group["prompt"] and group["prompt"].endswith(group["prefill"])
            assert group["answer"].lstrip("-").isdigit()
            assert len(group["completions"]) == 4
            for c in group["completions"]:
                assert set(c["rewards"]) == set(REWARD_WEIGHTS)
                # the recorded scores are what the reward functions give for this text and gold answer
                assert c["rewards"]["length_reward"] == pytest.approx(length_reward([c["text"]])[0])
                assert c["rewards"]["correctness"] == correctness(completions=[c["text"]], answer=[group["answer"]],
                                                                  prefill=[group["prefill"]])[0]
                assert c["total"] == pytest.approx(sum(REWARD_WEIGHTS[k] * v for k, v in c["rewards"].items()))
                scores.append(c["rewards"]["length_reward"])
        # ... and exactly what TRL trained on at that step
        assert sum(scores) / len(scores) == pytest.approx(metrics[step]["rewards/length_reward/mean"], abs=1e-6)


@pytest.mark.slow
def test_training_warns_on_clipped_completions_once(tiny_run):
    _, captured = tiny_run
    warnings = [m for m in captured.messages(logging.WARNING) if "max_completion_length" in m]
    assert len(warnings) == 1 and warnings[0].startswith("step 1:")
    assert any(m.startswith("step 4/4 | reward") for m in captured.messages(logging.INFO))


# ---- report_to ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["tensorboard", "wandb", "trackio"])
def test_report_to_reaches_grpo_config(value, tmp_path):
    from lowmem_grpo.recipe import Recipe
    from lowmem_grpo.train.grpo import build_grpo_config

    recipe = Recipe()
    recipe.train.report_to = value
    config = build_grpo_config(recipe, tmp_path, cpu_runtime(recipe), [1.0])
    assert config.report_to == [value]
    recipe.train.report_to = "none"
    assert build_grpo_config(recipe, tmp_path, cpu_runtime(recipe), [1.0]).report_to == []
    assert not hasattr(config, "completions_every")


@pytest.mark.parametrize("value", ["tensorboard", "wandb", "trackio"])
def test_report_to_without_its_package_is_bad_input(value):
    from lowmem_grpo.device import is_installed
    from lowmem_grpo.errors import BadInputError
    from lowmem_grpo.rundir.telemetry import REPORT_TO_PACKAGES, check_report_to

    module, package = REPORT_TO_PACKAGES[value]
    if is_installed(module):
        check_report_to(value)
        return
    with pytest.raises(BadInputError, match=f"pip install {package}"):
        check_report_to(value)


def test_completions_every_is_validated():
    from lowmem_grpo.errors import RecipeError
    from lowmem_grpo.recipe import Recipe
    from lowmem_grpo.recipe_rules import validate

    recipe = Recipe()
    recipe.train.completions_every = -1
    with pytest.raises(RecipeError, match="train.completions_every"):
        validate(recipe)
    assert Recipe().train.completions_every == 10


def _touch(size: int) -> bytearray:
    return bytearray(b"\x01") * size  # written, so resident (a zeroed buffer may stay unmapped)


def test_rss_watch_catches_a_peak_inside_its_span_only():
    import time

    from lowmem_grpo.rundir import rss

    if not rss.current_bytes():
        pytest.skip("no /proc/self/status")
    size = 300 * 2**20
    with rss.Watch() as outer:
        base = rss.current_bytes()
        with rss.Watch() as inner:
            block = _touch(size)
            time.sleep(0.1)  # held for ten sampling intervals
            del block  # freed before the span ends
        with rss.Watch() as after:
            small = _touch(2**20)
            del small
    assert inner.peak_bytes >= base + size * 0.95
    assert after.peak_bytes < base + size * 0.5
    assert outer.peak_bytes >= inner.peak_bytes  # a span holds the peaks of the spans inside it
    assert rss.high_water_bytes() >= base + size * 0.95  # the kernel's mark is never reset


def test_rss_watches_leave_the_process_peak_intact():
    """ru_maxrss (what `time -v` and benchmarks read) still holds a peak reached inside a watch."""
    import subprocess
    import sys

    code = ("from lowmem_grpo.rundir import rss\n"
            "with rss.Watch() as w:\n    x = bytearray(b'1') * (400 << 20)\n    del x\n"
            "with rss.Watch():\n    y = bytearray(b'1') * (10 << 20)\n"
            "print(w.exact, w.peak_bytes)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    _, status, usage = os.wait4(child.pid, 0)
    exact, peak = child.stdout.read().split()
    assert status == 0 and exact == "True"  # the peak of the process: exact, from the kernel's mark
    assert usage.ru_maxrss * 1024 >= int(peak) >= 400 << 20


def test_stage_peaks_are_written_in_order_with_their_seconds(tmp_path):
    from lowmem_grpo.rundir import layout, rss

    import time

    peaks = rss.StagePeaks()
    base = rss.current_bytes()
    with peaks.stage("first"):
        block = _touch(50 * 2**20)
        time.sleep(0.1)  # held for ten sampling intervals
        del block
    peaks.attach(tmp_path / "peak_rss.json")  # what came before is written at once
    assert [r["stage"] for r in layout.read_json(tmp_path / "peak_rss.json")["stages"]] == ["first"]
    with pytest.raises(ValueError):
        with peaks.stage("second"):
            raise ValueError("a failing stage is recorded too")
    data = layout.read_json(tmp_path / "peak_rss.json")
    assert [r["stage"] for r in data["stages"]] == ["first", "second"]
    assert data["sample_seconds"] == rss.SAMPLE_SECONDS and all(r["seconds"] >= 0 for r in data["stages"])
    assert all(isinstance(r["exact"], bool) for r in data["stages"])
    assert data["stages"][0]["peak_rss_bytes"] >= base + 45 * 2**20
    assert layout.read_json(tmp_path / "missing.json") is None


def test_the_reports_memory_tables_of_a_run(tmp_path):
    from lowmem_grpo.rundir.layout import read_jsonl
    from lowmem_grpo.rundir.report import memory_lines

    # a run directory as train() leaves it: peak_rss.json and the rss/<phase> keys of the GRPO steps
    (tmp_path / "peak_rss.json").write_text(json.dumps({"sample_seconds": 0.01, "stages": [
        {"stage": "load", "peak_rss_bytes": 2**30, "exact": False, "seconds": 3.0},
        {"stage": "grpo", "peak_rss_bytes": 3 * 2**30, "exact": True, "seconds": 30.0}]}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"stage": "prime", "step": 1, "rss/backward": 9.0},
        {"stage": "grpo", "step": 1, "rss/generation": 1.5, "rss/backward": 2.5},
        {"stage": "grpo", "step": 2, "rss/generation": 1.75, "rss/backward": 2.25}]) + "\n")
    lines = memory_lines(tmp_path, read_jsonl(tmp_path / "metrics.jsonl"))
    assert "| load | ~1.00 | 3 |" in lines and "| grpo | 3.00 | 30 |" in lines  # sampled (~) or exact
    assert lines[-1].endswith(": backward 2.50, generation 1.75")  # GRPO steps only, the largest


_MMAP_PROBE = """
import ctypes, sys
from lowmem_grpo.rundir import rss
libc = rss._glibc()
if libc is None or not hasattr(libc, "mallinfo2"):
    sys.exit(77)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert rss.limit_heap_retention() and rss.release_free_memory()
libc.free(libc.malloc(8 << 20))  # a large free: an unpinned threshold would rise past 3 MiB here
block = libc.malloc(3 << 20)
# glibc marks a chunk it mmapped with IS_MMAPPED (0x2) in the size word before the pointer
print(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 0x2)
libc.free(block)
"""


def test_pinned_mmap_threshold_gives_freed_blocks_back():
    """glibc: with the threshold pinned, a block of a few MiB (a CPU forward's tensor) is mmapped, so it leaves the
    process when freed, even after a large free (which, unpinned, moves blocks of that size into the heap). In a
    fresh process: glibc serves a request from a free heap chunk that fits before it considers mmap, and a long
    test session's heap holds such chunks."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MMAP_PROBE], capture_output=True, text=True, timeout=120)
    if done.returncode == 77:
        pytest.skip("not glibc >= 2.33")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"  # mmapped, not heap
