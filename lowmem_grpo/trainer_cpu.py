"""A GRPOTrainer whose log-prob pass runs in plain torch, for the hf backend without a GPU.

TRL 1.15 (the newest Unsloth allows) computes log-probs with a Triton kernel only, which has no
CPU driver; TRL 1.16 added a torch fallback. Until the pin can move, this subclass computes the
same quantities from full logits when the model is not on a GPU, and defers to TRL otherwise.
"""

from __future__ import annotations

from typing import Any


def cpu_safe_grpo_trainer() -> type:
    """GRPOTrainer subclass with a torch log-prob pass off-GPU (imports trl)."""
    import torch
    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    class CpuSafeGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that avoids the Triton log-prob kernel on CPU."""

        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                               attention_mask: torch.Tensor, logits_to_keep: int,
                                               batch_size: int | None = None, compute_entropy: bool = False,
                                               compute_aux_loss: bool = False, **multimodal: Any):
            if input_ids.device.type in ("cuda", "xpu") or any(v is not None for v in multimodal.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                    compute_aux_loss, **multimodal)
            batch_size = batch_size or input_ids.size(0)
            all_logps, all_entropies = [], []
            for start in range(0, input_ids.size(0), batch_size):
                ids = input_ids[start:start + batch_size]
                mask = attention_mask[start:start + batch_size]
                with self.accelerator.autocast():
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                # position t predicts token t+1: keep the logits of the completion tokens only
                logits = logits[:, -logits_to_keep - 1:-1, :].float() / self.temperature
                all_logps.append(selective_log_softmax(logits, ids[:, -logits_to_keep:]))
                if compute_entropy:
                    all_entropies.append(entropy_from_logits(logits))
            entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
            return torch.cat(all_logps, dim=0), entropies, None

    return CpuSafeGRPOTrainer
