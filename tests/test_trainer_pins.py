"""Pins on what lowmem_grpo.train.trainer relies on in TRL 1.15's and transformers' trainers: each private method
it overrides or calls, by signature and by the source lines the override depends on; and the check that no other
package module names a private TRL trainer method or attribute (a TRL bump then breaks one module, loudly here)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from transformers import Trainer  # noqa: E402
from trl import GRPOTrainer, SFTTrainer  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "lowmem_grpo"

# method -> (its parameters, source lines of GRPOTrainer that our use of it depends on)
GRPO_PRIVATE = {
    "_generate": (["self", "prompts"], [
        "self.rollout_func(prompts, self)",  # the engine's rollouts (lowmem_grpo.sampling.rollout)
        "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images",
    ]),
    "_generate_and_score_completions": (["self", "inputs"], [
        "self._generate(prompts)",  # the generation phase runs inside the batch preparation
        "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)",
    ]),
    "_calculate_rewards": (["self", "inputs", "prompts", "completions", "completion_ids_list"], [
        "rewards_per_func = gather(rewards_per_func)",  # every rank's rows, in rank order
        "return rewards_per_func",
    ]),
    "_generate_single_turn": (["self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                               "has_tool_images"], ["unwrapped_model.generate("]),
    "_get_per_token_logps_and_entropies": (
        ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
         "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
         "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids"],
        ["return logps, entropies, aux_loss"]),
    "_log_metric": (["self", "name", "value"], ["self._pending_metrics[name].append(value)"]),
    "log": (["self", "logs", "start_time"], [  # add_step_metrics: averaged into each log line, then cleared
        "for key, val in self._metrics[mode].items():",
        "self._metrics[mode].clear()",
    ]),
}


@pytest.mark.parametrize("name", sorted(GRPO_PRIVATE))
def test_grpo_trainer_methods_we_rely_on(name):
    assert trl.__version__ == "1.15.0", f"re-check lowmem_grpo.train.trainer and these pins for TRL {trl.__version__}"
    parameters, lines = GRPO_PRIVATE[name]
    method = getattr(GRPOTrainer, name)
    assert list(inspect.signature(method).parameters) == parameters
    source = inspect.getsource(method)
    missing = [line for line in lines if line not in source]
    assert not missing, f"GRPOTrainer.{name} no longer has: {missing}"


def test_the_entropy_bonus_flag_and_the_loss_order_we_rely_on():
    """CpuSafeGRPOTrainer keeps the entropy's graph only under TRL's entropy bonus; LowmemGRPOTrainer times the
    backward from compute_loss's return to training_step's (transformers' training_step: the loss, then backward)."""
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy" in init
    step = inspect.getsource(Trainer.training_step)
    loss_at = step.index("loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)")
    assert loss_at < step.index("self.accelerator.backward(loss, **kwargs)") < step.index("return loss.detach()")
    assert "super().training_step(model, inputs, num_items_in_batch)" in inspect.getsource(GRPOTrainer.training_step)
    assert list(inspect.signature(GRPOTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]


def test_sft_trainer_metrics_we_fill():
    """CpuSafeSFTTrainer's loss logs what SFTTrainer's does, into the same private fields."""
    assert list(inspect.signature(SFTTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    source = inspect.getsource(SFTTrainer.compute_loss)
    for line in ('self._metrics[mode]["entropy"].append(', 'self._metrics[mode]["mean_token_accuracy"].append(',
                 "self._total_train_tokens += "):
        assert line in source, line


def test_only_the_trainer_module_names_private_trl_trainer_members():
    """`grep` for every private name of TRL's trainers and vLLM generation (methods and attributes) over the
    package: one module."""
    private = {name for cls in (GRPOTrainer, SFTTrainer) for name in dir(cls) if re.fullmatch(r"_[a-z]\w*", name)}
    for cls in (GRPOTrainer, SFTTrainer):
        private |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", inspect.getsource(cls)))
    private -= set(dir(object))
    # TRL's vLLM generation: the attributes its colocate mode keeps (read by vllm_awake)
    from trl.generation.vllm_generation import VLLMGeneration

    vllm_private = set(re.findall(r"self\.(_[a-z]\w*)\s*=", inspect.getsource(VLLMGeneration)))
    assert "_llm_weights_sleeping" in vllm_private
    private |= vllm_private
    found = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        # an attribute read or set, or a method defined in a class (our own module-level helpers may share a name)
        names = {n for n in private if re.search(rf"(\.|^[ \t]+def ){re.escape(n)}\b", text, re.MULTILINE)}
        if names:
            found[str(path.relative_to(PACKAGE))] = sorted(names)
    assert set(found) == {"train/trainer.py"}, found
