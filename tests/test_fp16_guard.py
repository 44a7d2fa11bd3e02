"""fp16: NoSignalStepGuard skipping an optimizer step inside accelerate's optimizer wrapper with a real GradScaler.

Under fp16 mixed precision AcceleratedOptimizer.step is where GradScaler.step and update run; clipping unscales
the gradients before it. A skipped step must leave the scaler able to take the next step, its scale unchanged,
and the weights untouched. On CPU: torch.amp.GradScaler("cpu") in an AcceleratedOptimizer, no GPU needed.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from lowmem_grpo.train.callbacks import SKIPPED_STEP_KEY, NoSignalStepGuard

PLAN = [True, False, True, False, False, True]
"""Per step: whether its batch carries signal (a nonzero advantage); the others are skipped."""


class LoopTrainer:
    """What NoSignalStepGuard reads of a trainer, around a tiny model: a GRPO-shaped loss whose policy term is
    weighted by the advantages, plus a KL-like pull that has a gradient even when no advantage is nonzero."""

    def __init__(self, model: torch.nn.Module, optimizer: AcceleratedOptimizer, accelerator: Accelerator) -> None:
        self.model = model
        self.optimizer = optimizer
        self.accelerator = accelerator
        self.metrics = defaultdict(list)
        self.lowmem_guard = None

    def add_step_metrics(self, record) -> None:
        for key, value in record.items():
            self.metrics[key].append(value)

    def compute_loss(self, model, inputs):  # as LowmemGRPOTrainer's: the guard judges each training micro-batch
        self.lowmem_guard.judge(inputs)
        out = model(inputs["x"])
        return (inputs["advantages"] * out).sum() + 0.1 * out.pow(2).sum()


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
def test_skipped_steps_leave_the_fp16_grad_scaler_and_the_weights_alone(clip):
    accelerator = Accelerator(cpu=True)  # the state AcceleratedOptimizer reads; its own scaler is built here
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    # growth_interval=1: every stepped iteration doubles the scale, so a skip that counted as one would show
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), device_placement=False,
                                     scaler=scaler)
    trainer = LoopTrainer(model, optimizer, accelerator)
    guard = trainer.lowmem_guard = NoSignalStepGuard(trainer)  # as LowmemGRPOTrainer.__init__ makes it
    guard.on_train_begin(None, None, None)

    for step, signal in enumerate(PLAN):
        inputs = {"x": torch.randn(3, 4), "advantages": torch.full((3, 1), 1.0 if signal else 0.0)}
        loss = trainer.compute_loss(model, inputs)
        scaler.scale(loss).backward()
        if clip:  # what accelerator.clip_grad_norm_ does under fp16: unscale, then clip
            scaler.unscale_(optimizer.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        weights = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        optimizer.step()  # the next step's unscale_ raised here when a skip left the scaler "unscaled"
        optimizer.zero_grad()
        moved = any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
        if signal:
            assert moved and scaler.get_scale() == 2 * scale, step
        else:
            assert not moved and scaler.get_scale() == scale, step
    assert guard.skipped == PLAN.count(False)
    assert trainer.metrics[SKIPPED_STEP_KEY] == [0.0 if s else 1.0 for s in PLAN]
