"""benchmarks/step_cpu.py refuses to compare two runners whose configurations differ."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cpu.py"


@pytest.fixture(scope="module")
def step_cpu():
    spec = importlib.util.spec_from_file_location("step_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing heavy: the workers do
    return module


FINGERPRINT = {
    "trainer_class": "CpuSafeGRPOTrainer",
    "grpo": {"learning_rate": 1e-4, "num_generations": 4, "bf16": False, "seed": 42},
    "lora": {"r": 16, "lora_alpha": 32, "target_modules": ["k_proj", "q_proj"]},
    "param_dtypes": ["torch.float32"],
    "prompts_sha": "aaaa", "lora_init_sha": "bbbb",
    "rewards": [["correctness", 2.0], ["xml_count", 0.5]],
}


def test_identical_fingerprints_pass(step_cpu, capsys):
    step_cpu.check_same(FINGERPRINT, copy.deepcopy(FINGERPRINT), "tiny float32")
    out = capsys.readouterr().out
    assert "config tiny float32 lowmem:" in out and "config tiny float32 plain:" in out  # both printed
    assert "identical on both sides" in out


def test_differing_fingerprints_fail_loudly_naming_the_keys(step_cpu, capsys):
    plain = copy.deepcopy(FINGERPRINT)
    plain["grpo"]["learning_rate"] = 5e-6
    plain["param_dtypes"] = ["torch.bfloat16"]
    plain["lora_init_sha"] = "cccc"
    assert step_cpu.compare(FINGERPRINT, plain) == [
        "grpo.learning_rate: lowmem=0.0001 plain=5e-06",
        "lora_init_sha: lowmem='bbbb' plain='cccc'",
        "param_dtypes: lowmem=['torch.float32'] plain=['torch.bfloat16']",
    ]
    with pytest.raises(SystemExit) as stopped:
        step_cpu.check_same(FINGERPRINT, plain, "tiny float32")
    assert stopped.value.code not in (0, None)  # a message: exit status 1
    assert "grpo.learning_rate" in str(stopped.value) and "lora_init_sha" in str(stopped.value)
    captured = capsys.readouterr()
    assert "NOT LIKE FOR LIKE (tiny float32)" in captured.err and "param_dtypes" in captured.err


def test_a_key_only_one_side_has_is_a_difference(step_cpu):
    plain = copy.deepcopy(FINGERPRINT)
    del plain["rewards"]
    plain["grpo"]["beta"] = 0.04
    assert step_cpu.compare(FINGERPRINT, plain) == ["grpo.beta: lowmem=None plain=0.04",
                                                    "rewards: lowmem=[['correctness', 2.0], ['xml_count', 0.5]] plain=None"]


def test_both_runners_are_built_from_the_one_spec(step_cpu, tmp_path):
    overrides = step_cpu.lowmem_overrides(step_cpu.SPEC, "/models/tiny", tmp_path)
    assert "model.dtype=float32" in overrides and "train.warmup_ratio=0.0" in overrides
    for key, value in step_cpu.SPEC["grpo"].items():
        assert any(o.startswith(f"train.{step_cpu.RECIPE_NAMES.get(key, key)}=") for o in overrides), key
    assert 'rewards={"correctness": 2.0, "integer": 0.5, "strict_format": 0.5, "soft_format": 0.5, "xml_count": 0.5}' \
        in overrides
