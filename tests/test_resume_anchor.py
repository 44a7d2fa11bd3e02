"""`--resume` of a run with a KL anchor (train.beta > 0), the path an out-of-memory error continues by too: the
policy continues from the checkpoint's adapter (or the complete primed one), and the reference stays the run's
original one (here the primed adapter), whatever TRL copies into `ref` when the trainer is built.

Tiny model, float32, hf backend on CPU, in-process through the CLI's `main`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from resilience_helpers import (adapter_tensors, cli_inprocess, metrics, needs_cpu_determinism,  # noqa: F401
                                one_torch_thread, tiny_args)

ANCHOR = ("model.dtype=float32", "train.beta=0.04", "prime.max_steps=2", "train.save_total_limit=5")
"""A KL anchor to a primed adapter (priming makes the reference differ from a fresh LoRA, whose B is zero)."""


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _same_bits(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _reference(checkpoint: Path) -> dict:
    return adapter_tensors(checkpoint / "ref")


def _copy_as_killed_after(run: Path, target: Path, step: int) -> None:
    """The run directory as a kill -9 right after checkpoint-`step` leaves it (later checkpoints and adapter/ gone;
    log lines past the step stay, resume rewinds them)."""
    shutil.copytree(run, target)
    for folder in [*target.glob("checkpoint-*"), target / "adapter"]:
        if folder.name == "adapter" or int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)


@pytest.mark.slow
@needs_cpu_determinism
def test_resume_with_a_kl_anchor_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, *ANCHOR, steps=3, save_steps=1))
    assert code == 0, log[-3000:]
    primed = adapter_tensors(run / "primed_adapter")
    assert _same_bits(_reference(run / "checkpoint-3"), primed)  # TRL's copy at the first build is the original
    _copy_as_killed_after(run, resumed, 1)

    code, log = cli_inprocess("train", "--resume", str(resumed))
    assert code == 0 and "checkpoint-1" in log, log[-3000:]
    assert _max_diff(adapter_tensors(resumed / "adapter"), adapter_tensors(run / "adapter")) <= 1e-6
    for step in (2, 3):  # the reference every resumed step trained against is the primed adapter, bit for bit
        assert _same_bits(_reference(resumed / f"checkpoint-{step}"), primed)
    ours = [m["reward"] for m in metrics(resumed) if "reward" in m]
    assert ours == [m["reward"] for m in metrics(run) if "reward" in m]


@pytest.mark.slow
@needs_cpu_determinism
def test_resume_after_priming_loads_the_primed_adapter_and_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """Killed after priming, before any checkpoint: the resumed run loads primed_adapter/ (complete) instead of
    priming again, so TRL's reference is the primed adapter and the run ends as the uninterrupted one did."""
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, *ANCHOR, steps=2, save_steps=2))
    assert code == 0, log[-3000:]
    _copy_as_killed_after(run, resumed, 0)
    code, log = cli_inprocess("train", "--resume", str(resumed))
    assert code == 0 and "is complete, loaded" in log and "priming 2 steps" not in log, log[-3000:]
    primed = adapter_tensors(run / "primed_adapter")
    assert _same_bits(_reference(resumed / "checkpoint-2"), primed)
    assert _same_bits(adapter_tensors(resumed / "adapter"), adapter_tensors(run / "adapter"))
    prime_lines = [m["step"] for m in metrics(resumed) if m.get("stage") == "prime" and "loss" in m]
    assert prime_lines == [1, 2]  # kept once, not rewound
