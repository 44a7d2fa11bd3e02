"""Reward functions for GRPO (TRL protocol), standard library only.

Importing this package registers the GSM8K rewards; look them up with
``get_reward("correctness")`` or an import string ``"package.module:function"``.
"""

from .chain import chain_steps
from .gsm8k import (GSM8K_DEFAULT_WEIGHTS, completion_texts, correctness, expression, integer, soft_format,
                    strict_format, xml_count)
from .registry import InvalidRewardSpecError, RewardFunc, UnknownRewardError, available_rewards, get_reward, register
