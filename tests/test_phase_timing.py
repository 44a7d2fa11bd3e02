"""Phase timing per step (time/<phase> keys, tokens_per_s, the console line, the report) and the
CPU log-prob pass that computes logits for the completion positions only."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from types import SimpleNamespace

import pytest

from tiny_run import train_tiny

PHASE_KEYS = ["time/generation", "time/rewards", "time/prepare_other", "time/loss_forward", "time/backward",
              "time/optimizer", "time/other", "time/checkpoint_telemetry"]


def timed_record(step: int, seconds: float = 2.0) -> dict:
    shares = [0.6, 0.01, 0.01, 0.15, 0.15, 0.02, 0.01, 0.05]
    record = {"stage": "grpo", "step": step, "reward": 0.5, "loss": 0.1, "step_time": seconds * 0.9,
              **{k: seconds * s for k, s in zip(PHASE_KEYS, shares)}}
    record.update({"time/step": seconds, "time/sampling_share": 0.6, "tokens_per_s": 120.0})
    return record


# ---- the timer driven as the trainer drives it: the arithmetic -----------------------------------

class Trainer:
    """What PhaseTimer reads of a trainer (lowmem_grpo.train.trainer.LowmemGRPOTrainer): add_step_metrics."""

    def __init__(self) -> None:
        self.metrics = defaultdict(list)

    def add_step_metrics(self, record: dict) -> None:
        for key, value in record.items():
            self.metrics[key].append(value)


def started(trainer: Trainer, device: str = "cpu"):
    """A PhaseTimer as LowmemGRPOTrainer makes it, at the start of training on `device` (its TrainingArguments')."""
    from lowmem_grpo.train.callbacks import PhaseTimer

    timer = PhaseTimer(trainer)
    timer.on_train_begin(SimpleNamespace(device=SimpleNamespace(type=device)), None, None)
    return timer


def run_phases(timer, clock: list[float]) -> None:
    """One step's phases as LowmemGRPOTrainer's overrides open and close them, on the test's clock."""
    with timer.span("_prepare"):
        clock[0] += 0.05  # tokenizing, advantages
        with timer.span("generation"):
            clock[0] += 1.0
        timer.count_tokens(40)
        with timer.span("rewards"):
            clock[0] += 0.1
    with timer.span("loss_forward"):
        clock[0] += 0.4
    timer.open("backward")
    clock[0] += 0.3
    timer.close("backward")


def test_phase_timer_sums_its_phases_to_the_step(monkeypatch):
    from lowmem_grpo.train import callbacks

    clock = [100.0]
    monkeypatch.setattr(callbacks.WallClock, "mark", lambda self: clock[0])
    trainer = Trainer()
    timer = started(trainer)
    state = SimpleNamespace(global_step=1, max_steps=2)
    for step in (1, 2):
        timer.on_step_begin(None, state, None)
        run_phases(timer, clock)
        timer.close("backward")  # nothing open: nothing counted twice
        timer.on_pre_optimizer_step(None, state, None)
        clock[0] += 0.02
        timer.on_optimizer_step(None, state, None)
        clock[0] += 0.01  # clipping, scheduler
        timer.on_step_end(None, state, None)
        clock[0] += 0.5  # the log line and a checkpoint: the next step's checkpoint_telemetry
    metrics = trainer.metrics
    assert metrics["time/generation"] == pytest.approx([1.0, 1.0])
    assert metrics["time/rewards"] == pytest.approx([0.1, 0.1])
    assert metrics["time/prepare_other"] == pytest.approx([0.05, 0.05])
    assert metrics["time/loss_forward"] == pytest.approx([0.4, 0.4])
    assert metrics["time/backward"] == pytest.approx([0.3, 0.3])
    assert metrics["time/optimizer"] == pytest.approx([0.02, 0.02])
    assert metrics["time/other"] == pytest.approx([0.01, 0.01])
    assert metrics["time/checkpoint_telemetry"] == pytest.approx([0.0, 0.5])
    assert metrics["time/step"] == pytest.approx([1.88, 2.38])
    assert metrics["tokens_per_s"] == pytest.approx([40.0, 40.0])
    assert metrics["time/sampling_share"] == pytest.approx([1.0 / 1.88, 1.0 / 2.38])
    assert {"rss/generation", "rss/prepare", "rss/backward"} <= set(metrics)
    state.global_step = 2
    timer.on_epoch_end(None, state, SimpleNamespace(should_training_stop=False))
    assert metrics["time/checkpoint_telemetry"][-1] == pytest.approx(0.5)  # the last step's: into the summary line


def test_a_phase_left_open_is_not_counted_and_one_that_raises_is_closed(monkeypatch):
    from lowmem_grpo.train import callbacks

    clock = [0.0]
    monkeypatch.setattr(callbacks.WallClock, "mark", lambda self: clock[0])
    timer = started(Trainer())
    with pytest.raises(RuntimeError), timer.span("generation"):
        clock[0] += 1.0
        raise RuntimeError("out of memory")
    timer.open("backward")  # a loss computed outside a training step leaves it open: the next open restarts it
    clock[0] += 5.0
    timer.open("backward")
    clock[0] += 0.3
    timer.close("backward")
    spans = [(phase, end - start) for phase, start, end in timer.spans]
    assert spans == [("generation", 1.0), ("backward", pytest.approx(0.3))]
    assert not timer.opened  # no RSS watch left running


class FakeEvent:
    """torch.cuda.Event's timing interface, on the test's clock (milliseconds, as CUDA reports them)."""

    clock: list[float] = [0.0]
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = FakeEvent.clock[0]

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0


def test_on_cuda_the_timer_uses_events_and_waits_once_a_step(monkeypatch):
    import torch

    from lowmem_grpo.train import callbacks

    clock = [0.0]
    monkeypatch.setattr(FakeEvent, "clock", clock)
    monkeypatch.setattr(FakeEvent, "synchronized", 0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    trainer = Trainer()
    timer = started(trainer, "cuda")
    assert isinstance(timer.clock, callbacks.CudaClock)
    state = SimpleNamespace(global_step=1, max_steps=1)
    timer.on_step_begin(None, state, None)
    run_phases(timer, clock)
    assert FakeEvent.synchronized == 0  # nothing waits for the GPU inside the step
    timer.on_step_end(None, state, None)
    assert FakeEvent.synchronized == 1
    metrics = trainer.metrics
    assert metrics["time/generation"] == pytest.approx([1.0]) and metrics["time/backward"] == pytest.approx([0.3])
    assert metrics["time/step"] == pytest.approx([1.85])


def test_console_line_shows_sampling_share_and_tokens_per_second():
    from lowmem_grpo.rundir.telemetry import console_line

    line = console_line(timed_record(3, 26.1), 3, 10, 60.0, [])
    assert "26.1s/step (gen 60%, 120 tok/s)" in line
    assert "1.8s/step" in console_line({"reward": 0.1, "step_time": 1.8}, 1, 2, 1.0, [])  # no timing: TRL's time


def test_report_has_the_time_line_and_plot(tmp_path):
    from lowmem_grpo.rundir.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    records = [timed_record(s) for s in (1, 2, 3)]
    records.append({"stage": "grpo", "step": 3, "train_runtime": 7.0, "time/checkpoint_telemetry": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report(run).read_text()
    assert "Time per step: 2 s (generation 60%, rewards 1%, prepare_other 1%, loss_forward 15%" in report
    assert "after the last step (its log line and checkpoint): 0.25 s" in report
    assert "(plots/time.png)" in report and (run / "plots" / "time.png").stat().st_size > 5000


# ---- a real tiny run ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_run_logs_phase_keys_that_sum_to_the_step(tiny_model_dir, tmp_path):
    from lowmem_grpo.rundir.telemetry import read_metrics

    run, logs = train_tiny(tiny_model_dir, tmp_path / "run", "train.max_steps=3", "train.save_steps=2")
    records = read_metrics(run)
    steps = [r for r in records if r.get("stage") == "grpo" and "train_runtime" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        missing = [k for k in PHASE_KEYS + ["time/step", "time/sampling_share", "tokens_per_s"] if k not in r]
        assert not missing, (missing, r)
        total = sum(r[k] for k in PHASE_KEYS)
        assert total == pytest.approx(r["time/step"], rel=0.02), r
        named = total - r["time/other"]
        assert named >= 0.9 * r["time/step"], r  # the named phases cover the step
        assert r["time/step"] >= r["step_time"] > 0 and r["time/generation"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["time/sampling_share"] <= 1
    assert steps[2]["time/checkpoint_telemetry"] > 0  # checkpoint-2 was written in the gap before step 3
    summary = [r for r in records if "train_runtime" in r and r.get("stage") == "grpo"]
    assert summary and summary[-1]["time/checkpoint_telemetry"] > 0  # the final checkpoint's gap
    assert any("s/step (gen " in m and "tok/s)" in m for m in logs.messages())
    assert "Time per step:" in (run / "report.md").read_text() and (run / "plots" / "time.png").exists()


# ---- the CPU log-prob pass: logits for the completion positions only ----------------------------------------------

def _old_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, temperature):
    """The pass as it was: full logits over every position, then the completion slice (entropy with grad)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, -logits_to_keep - 1:-1, :].float() / temperature
    return selective_log_softmax(logits, input_ids[:, -logits_to_keep:]), entropy_from_logits(logits)


@pytest.mark.slow
@pytest.mark.parametrize("entropy_bonus", [False, True])
def test_completion_only_logits_equal_the_full_logits_path(tiny_model_dir, entropy_bonus):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.train.cpu_logprobs import logps_and_entropies

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False))  # non-zero B: the adapter changes logits
    ids = torch.randint(3, model.config.vocab_size, (4, 20))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded prompt
    results = []
    for run in ("old", "new"):
        model.zero_grad()
        if run == "old":
            logps, entropy = _old_logps_and_entropies(model, ids, mask, 7, 0.7)
        else:
            logps, entropy, _ = logps_and_entropies(
                model, ids, mask, 7, 2, temperature=0.7, compute_entropy=True, entropy_grad=entropy_bonus,
                shared_prompt=False, attention=True, autocast=contextlib.nullcontext)  # full rows here
            assert entropy.requires_grad == entropy_bonus  # no graph kept for a logged-only entropy
        (logps.sum() + (entropy.sum() if entropy_bonus else 0)).backward()  # the loss uses it only with a bonus
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((logps.detach(), entropy.detach(), grads))
    (old_logps, old_entropy, old_grads), (new_logps, new_entropy, new_grads) = results
    assert new_logps.shape == (4, 7)
    torch.testing.assert_close(new_logps, old_logps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_entropy, old_entropy, rtol=1e-5, atol=1e-6)
    for new, old in zip(new_grads, old_grads):  # the same loss both ways: the same gradients
        torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-6)
