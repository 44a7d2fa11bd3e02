"""Test helpers for the prime stage: a reward that reports the prefill it was given, and a start-state probe.

Importable by name in pytest (tests/ is on sys.path) and in CLI subprocesses with PYTHONPATH=tests.
Nothing heavy is imported at module level, so Unsloth can still be imported first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def prefill_seen(completions, prefill=None, **kwargs):
    """1.0 when the trainer passed this completion's prefill and the scored text starts with it."""
    from lowmem_grpo.rewards import completion_texts

    if prefill is None:
        return [0.0] * len(completions)
    texts = completion_texts(completions, prefill=prefill)
    return [1.0 if p and text.startswith(p) else 0.0 for p, text in zip(prefill, texts)]


def lora_state(model: Any) -> dict[str, Any]:
    """The adapter's tensors under the names `save_pretrained` writes them (adapter name dropped)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu").clone() for k, v in get_peft_model_state_dict(model).items()}


def start_state_probe(save_to: Path | None = None) -> Any:
    """A TrainerCallback that records the adapter's weights when training begins (imports transformers).

    The tensors are kept on `probe.state` and, when `save_to` is given, written there as safetensors.
    """
    from transformers import TrainerCallback

    class StartStateProbe(TrainerCallback):
        """Captures the LoRA weights the trainer starts from."""

        def __init__(self) -> None:
            self.state: dict[str, Any] | None = None
            self.trainer_args: str | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
            self.state = lora_state(model)
            self.trainer_args = type(args).__name__
            if save_to is not None:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in self.state.items()}, str(save_to),
                          metadata={"trainer_args": self.trainer_args})

    return StartStateProbe()
