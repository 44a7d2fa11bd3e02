"""The CPU trainer's row-at-a-time log-prob pass: bitwise TRL's selective_log_softmax and entropy_from_logits on the
float32 logits / T, values and gradients, in float32 and bfloat16, without holding the float32 copy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trl.trainer.utils import entropy_from_logits, selective_log_softmax  # noqa: E402

from lowmem_grpo.train.cpu_logprobs import completion_logps  # noqa: E402


def _pass(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float, ours: bool):
    """The trainer's pass from hidden states: LM head on C + 1 positions, the last dropped, log-probs, entropies."""
    logits = head(hidden)[:, :-1, :]
    if ours:
        logps, entropy = completion_logps(logits, targets, temperature, compute_entropy=True)
    else:
        scaled = logits.float() / temperature
        logps = selective_log_softmax(scaled, targets)
        with torch.no_grad():
            entropy = entropy_from_logits(scaled)
    weights = torch.linspace(-1.0, 2.0, logps.numel()).reshape(logps.shape)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_row_log_probs_entropies_and_gradients_are_bitwise_trls(dtype, temperature):
    torch.manual_seed(0)
    rows, positions, width, vocab = 3, 6, 16, 49152  # the real vocabulary: the kernels' vector paths as in training
    head = torch.nn.Linear(width, vocab, bias=False).to(dtype)
    hidden = (torch.randn(rows, positions + 1, width) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows, positions))
    results = []
    for ours in (False, True):
        head.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        results.append(_pass(x, head, targets, temperature, ours))
    for ref, got, name in zip(results[0], results[1], ("logps", "entropy", "hidden grad", "head grad")):
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    assert results[1][2].abs().sum() > 0  # a real gradient reached the hidden states


def test_no_grad_pass_and_the_entropy_bonus_path():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 300)
    targets = torch.randint(0, 300, (2, 5))
    with torch.no_grad():
        logps, entropy = completion_logps(logits, targets, 0.7, compute_entropy=True)
        assert torch.equal(logps, selective_log_softmax(logits.float() / 0.7, targets))
        assert torch.equal(entropy, entropy_from_logits(logits.float() / 0.7))
    assert completion_logps(logits, targets, 0.7)[1] is None
    # an entropy in the loss (TRL's entropy bonus) needs its gradient: it gets one
    leaf = logits.clone().requires_grad_()
    logps, entropy = completion_logps(leaf, targets, 0.7, compute_entropy=True, entropy_grad=True)
    entropy.sum().backward()
    assert entropy.requires_grad and leaf.grad.abs().sum() > 0
