"""What `model.dtype=auto` means on a CPU, decided by the CPU or from outside (LOWMEM_GRPO_CPU_DTYPE), and a tiny
run + export under BOTH resolutions on any machine: a CPU with native bfloat16 and one without each see one of them
when the suite runs unattended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_grpo.device import CPU_DTYPE_ENV, CudaFacts, cpu_auto_dtype
from lowmem_grpo.distributed import Launch
from lowmem_grpo.doctor import cpu_dtype_line
from lowmem_grpo.errors import EXIT_BAD_INPUT, BadInputError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import apply_overrides
from lowmem_grpo.runtime import resolve
from tiny_run import CPU_RECIPE, TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[1]


def test_auto_follows_the_cpus_native_bf16_unless_the_environment_decides():
    assert cpu_auto_dtype({}, native_bf16=True).dtype == "bfloat16"
    assert cpu_auto_dtype({}, native_bf16=False).dtype == "float32"
    assert cpu_auto_dtype({CPU_DTYPE_ENV: "auto"}, native_bf16=True).dtype == "bfloat16"
    forced = cpu_auto_dtype({CPU_DTYPE_ENV: "float32"}, native_bf16=True)
    assert forced.dtype == "float32" and CPU_DTYPE_ENV in forced.reason
    assert cpu_auto_dtype({CPU_DTYPE_ENV: " BFloat16 "}, native_bf16=False).dtype == "bfloat16"
    assert "native" in cpu_auto_dtype({}, native_bf16=True).reason


NO_GPU = CudaFacts(torch_cuda=None, available=False)


def _dtype(dtype: str, environ: dict[str, str], facts: CudaFacts = NO_GPU) -> str:
    return resolve(apply_overrides(Recipe(), [f"model.dtype={dtype}"]), Launch(), facts, environ).dtype


def test_the_setting_changes_only_what_auto_means_on_a_cpu():
    env = {CPU_DTYPE_ENV: "bfloat16"}
    assert _dtype("auto", env) == "bfloat16"
    assert _dtype("auto", {CPU_DTYPE_ENV: "float32"}) == "float32"
    assert _dtype("float32", env) == "float32"  # an explicit dtype wins
    turing = CudaFacts(torch_cuda="12.6", available=True, capability=(7, 5))
    assert _dtype("auto", env, turing) == "float16"  # GPUs untouched
    assert _dtype("auto", {}) == cpu_auto_dtype({}).dtype  # this CPU's own answer
    with pytest.raises(BadInputError, match=CPU_DTYPE_ENV):  # a CPU run stops on it, explicit dtype or not
        _dtype("float32", {CPU_DTYPE_ENV: "half"})


def test_an_unknown_value_is_bad_input_naming_the_setting_and_the_values():
    with pytest.raises(BadInputError) as caught:
        cpu_auto_dtype({CPU_DTYPE_ENV: "fp32"}, native_bf16=True)
    assert caught.value.exit_code == EXIT_BAD_INPUT
    assert CPU_DTYPE_ENV in str(caught.value) and "'fp32'" in str(caught.value)
    assert "bfloat16" in caught.value.fix and "float32" in caught.value.fix


def test_doctor_reports_the_resolution_and_its_reason():
    line, problems = cpu_dtype_line(True, {})
    assert "auto -> bfloat16" in line and "native" in line and problems == []
    line, problems = cpu_dtype_line(True, {CPU_DTYPE_ENV: "float32"})
    assert "auto -> float32" in line and f"set by {CPU_DTYPE_ENV}" in line and problems == []
    line, problems = cpu_dtype_line(False, {CPU_DTYPE_ENV: "half"})
    assert "unknown" in line and len(problems) == 1 and CPU_DTYPE_ENV in problems[0]


def run_cli(*args: str, dtype: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CPU_DTYPE_ENV: dtype, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=env)


def test_a_bad_setting_stops_train_with_exit_2_before_anything_is_written(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    done = run_cli("train", str(CPU_RECIPE), f"model.name={tiny_model_dir}", f"output.dir={run}", dtype="float33")
    assert done.returncode == 2, done.stderr[-2000:]
    assert CPU_DTYPE_ENV in done.stderr and not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_and_its_exports_under_each_resolution(dtype, tiny_model_dir, tmp_path):
    """Trains with model.dtype=auto resolved to `dtype` through the environment, then exports: the export's precision
    is measured on the adapter, not taken from the run's dtype, and its proof is judged in it."""
    run = tmp_path / "run"
    done = run_cli("train", str(CPU_RECIPE), f"model.name={tiny_model_dir}", f"output.dir={run}", "model.dtype=auto",
                   *TINY_OVERRIDES, "train.max_steps=2", "train.save_steps=2", dtype=dtype)
    assert done.returncode == 0, done.stderr[-3000:]
    env = json.loads((run / "env.json").read_text())
    assert env["dtype"] == dtype
    assert env["cpu_auto_dtype"]["dtype"] == dtype and CPU_DTYPE_ENV in env["cpu_auto_dtype"]["reason"]
    assert f"model.dtype=auto -> {dtype}" in done.stderr

    from lowmem_grpo.export.formats import export  # in-process: the result object carries each check's bound
    from lowmem_grpo.export.proof import MAX_EFFECT_ERROR

    merged = export(run, "merged", tmp_path / "merged")
    assert merged.dtype == merged.precision["dtype"] and merged.checks["prove"] <= merged.tolerance
    assert merged.effect["error"] <= MAX_EFFECT_ERROR
    exact = export(run, "merged", tmp_path / "exact", dtype="float32")  # an exact merge: summation order only
    assert exact.checks["prove"] <= 1e-4
