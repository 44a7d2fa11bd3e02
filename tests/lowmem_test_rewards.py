"""Rewards that vary on a random tiny model, so that GRPO has a gradient in tests.

Loaded through the `module:function` import-string path: `lowmem_test_rewards:length_reward`.
"""


def length_reward(completions, **kwargs):
    """Longer completions score higher (capped), which any sampler varies on."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [min(len(t), 200) / 200.0 for t in texts]
