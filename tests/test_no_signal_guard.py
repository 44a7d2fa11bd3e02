"""The no-signal guard (lowmem_grpo.train.callbacks.NoSignalStepGuard): no optimizer step without an informative
group, on a stub trainer and on the tiny model through build_trainer; the trainer class the Runtime picks."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilience_helpers import CPU_RECIPE


def _tiny_recipe(model_dir: Path, run_dir: Path, *extra: str):
    from lowmem_grpo.recipe_io import load_recipe

    return load_recipe(str(CPU_RECIPE), [
        f"model.name={model_dir}", "model.backend=hf", f"output.dir={run_dir}", "prime.enabled=false",
        "train.preflight.enabled=false", "train.max_completion_length=16", "train.max_truncated_targets=1",
        "train.mask_truncated_completions=false", "train.num_generations=4",
        "train.per_device_train_batch_size=8", "train.save_steps=10", "train.completions_every=0",
        *extra])


def _trainer(model_dir: Path, run_dir: Path, *extra: str):
    """A GRPO trainer built as train() builds it (build_trainer), on the tiny model."""
    from datasets import Dataset

    from lowmem_grpo.backends import load, start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.recipe import resolved_rewards
    from lowmem_grpo.rewards import get_reward
    from lowmem_grpo.train.grpo import build_trainer

    recipe = _tiny_recipe(model_dir, run_dir, *extra)
    loaded = load(recipe, start(recipe, Launch())[0], model_path=str(model_dir))
    examples = recipe_examples(load_train_rows(recipe.data), loaded.tokenizer, recipe.data)
    weights = resolved_rewards(recipe)
    trainer = build_trainer(loaded, recipe, Dataset.from_list(examples), run_dir, [get_reward(n) for n in weights],
                            list(weights.values()), [])
    return trainer, loaded


def test_the_runtime_picks_the_cpu_trainer_for_hf_on_cpu_only():
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe import Recipe
    from lowmem_grpo.recipe_io import apply_overrides
    from lowmem_grpo.runtime import resolve
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer, LowmemGRPOTrainer, grpo_trainer_class

    gpu = CudaFacts(torch_cuda="12.6", available=True, capability=(8, 6))
    on_gpu = {b: resolve(apply_overrides(Recipe(), [f"model.backend={b}"]), Launch(), gpu) for b in ("unsloth", "hf")}
    assert grpo_trainer_class(on_gpu["unsloth"]) is LowmemGRPOTrainer is grpo_trainer_class(on_gpu["hf"])
    on_cpu = resolve(apply_overrides(Recipe(), ["model.backend=hf"]), Launch(), CudaFacts(torch_cuda=None, available=False))
    assert grpo_trainer_class(on_cpu) is CpuSafeGRPOTrainer


@pytest.mark.slow
def test_a_batch_without_an_informative_group_moves_no_weight(tiny_model_dir, tmp_path):
    """Correctness alone on a random model: every group is flat, every advantage 0. The
    optimizer does not step (AdamW's weight decay would shrink lora_A, its momentum would carry old steps), and
    each step logs optimizer/skipped_no_signal = 1."""
    import torch

    trainer, loaded = _trainer(tiny_model_dir, tmp_path, "data.limit=2", "train.max_steps=2",
                               "rewards={correctness: 2.0}", "train.weight_decay=0.1")
    lora = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = [n for n, p in loaded.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert moved == []
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(h["frac_reward_zero_std"] == 1.0 for h in logged)
    assert [h["optimizer/skipped_no_signal"] for h in logged] == [1.0, 1.0]
    assert trainer.state.global_step == 2  # the steps still count (and the schedule moves on)


class _StubAccelerator:
    num_processes = 1


class _StubModel:
    training = True


class _StubTrainer:
    """What NoSignalStepGuard touches of a trainer (lowmem_grpo.train.trainer.LowmemGRPOTrainer): optimizer,
    accelerator, add_step_metrics; its compute_loss hands each training micro-batch to the guard."""

    def __init__(self, optimizer) -> None:
        from collections import defaultdict

        self.optimizer = optimizer
        self.accelerator = _StubAccelerator()
        self.model = _StubModel()
        self.metrics = defaultdict(list)
        self.lowmem_guard = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.lowmem_guard.judge(inputs)
        return 0.0

    def add_step_metrics(self, record) -> None:
        for key, value in record.items():
            self.metrics[key].append(value)


def test_the_guard_skips_a_step_without_signal_and_steps_when_it_cannot_judge():
    import torch

    from lowmem_grpo.train.callbacks import SKIPPED_STEP_KEY, NoSignalStepGuard

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.zeros(3)
    trainer = _StubTrainer(torch.optim.AdamW([weight], lr=0.1, weight_decay=0.5))
    guard = trainer.lowmem_guard = NoSignalStepGuard(trainer)  # as LowmemGRPOTrainer.__init__ makes it
    guard.on_train_begin(None, None, None)
    flat = {"advantages": torch.zeros(4), "completion_mask": torch.ones(4, 5)}
    cut = {"advantages": torch.tensor([0.0, 1.0, -1.0, 0.0]), "completion_mask": torch.tensor([[1] * 5, [0] * 5,
                                                                                               [0] * 5, [1] * 5])}
    varied = {"advantages": torch.tensor([0.0, 1.0, -1.0, 0.0]), "completion_mask": torch.ones(4, 5)}
    for batch in (flat, cut):  # all advantages 0; the varied rows all cut off and masked
        trainer.compute_loss(None, batch)
        trainer.optimizer.step()
        assert torch.equal(weight.detach(), torch.ones(3))  # weight decay did not touch it
    trainer.compute_loss(None, flat)
    trainer.compute_loss(None, varied)  # one micro-batch of the accumulation window varies: the step is taken
    trainer.optimizer.step()
    assert not torch.equal(weight.detach(), torch.ones(3))
    moved = weight.detach().clone()
    trainer.optimizer.step()  # no micro-batch went through compute_loss: nothing judged, the step is taken
    assert not torch.equal(weight.detach(), moved)
    assert trainer.metrics[SKIPPED_STEP_KEY] == [1.0, 1.0, 0.0, 0.0] and guard.skipped == 2
