"""Shared fixtures: tiny models built once per session, and an isolated model cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # lowmem_test_rewards and tiny are importable by name


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny llama model folder (random weights, tiny tokenizer with a chat template)."""
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
