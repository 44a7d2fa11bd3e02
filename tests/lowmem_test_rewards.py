"""Rewards that vary on a random tiny model, so that GRPO has a gradient in tests (and one that is flat for some
problems, for dynamic sampling).

Loaded through the `module:function` import-string path: `lowmem_test_rewards:length_reward`.
"""


def length_reward(completions, **kwargs):
    """Longer completions score higher (capped), which any sampler varies on."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [min(len(t), 200) / 200.0 for t in texts]


def length_on_odd_ids(completions, problem_id, **kwargs):
    """length_reward for problems with an odd `problem_id`, 0.0 for even ones: with a correctness reward that a
    random model never earns, the groups of even problems are flat (zero variance) and the odd ones vary."""
    return [score if int(pid) % 2 else 0.0 for score, pid in zip(length_reward(completions), problem_id)]
