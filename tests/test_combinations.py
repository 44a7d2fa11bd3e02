"""lowmem_grpo.combinations: the target a run is on, how GRPO samples there, and the combinations `check` refuses
before any model loads (the CLI's side, exit codes and what validate imports, is in tests/test_validate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowmem_grpo.combinations import RunTarget, check, rollout_plan, run_target
from lowmem_grpo.distributed import Launch, launch, launcher_environment
from lowmem_grpo.errors import BadInputError, RecipeError
from lowmem_grpo.recipe_io import load_recipe

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
GPU_RECIPE = str(REPO / "recipes" / "qwen2_5_1_5b_gsm8k.py")
ACCELERATE = REPO / "recipes" / "accelerate"
ONE, ZERO3, ZERO2 = Launch(), Launch(2, 3), Launch(2, 2)


def _recipe(*overrides: str, path: str = CPU_RECIPE):
    return load_recipe(path, list(overrides))


def _refused(recipe, target: RunTarget, *named: str) -> str:
    with pytest.raises(BadInputError) as caught:
        check(recipe, target)
    text = str(caught.value)
    assert caught.value.exit_code == 2 and caught.value.fix
    for word in named:
        assert word in text or word in caught.value.fix, (word, text, caught.value.fix)
    return text


def test_rollout_plan_cases():
    plan = rollout_plan(_recipe(), "hf", "cpu")
    assert plan.engine and not plan.calculator
    assert not rollout_plan(_recipe(), "hf", "cuda").engine  # TRL's generation
    assert not rollout_plan(_recipe(), "unsloth", "cuda").engine
    assert not rollout_plan(_recipe("train.sampling_engine=false"), "hf", "cpu").engine
    assert not rollout_plan(_recipe("train.top_p=0.9"), "hf", "cpu").engine  # sampling the engine does not do
    for backend, device in (("hf", "cuda"), ("hf", "cpu"), ("unsloth", "cuda")):
        on = rollout_plan(_recipe("data.calculator=true"), backend, device)
        assert on.engine and on.calculator  # the calculator samples through the engine on either backend
    assert rollout_plan(_recipe("data.calculator=true", "train.sampling_engine=false"), "hf", "cpu").calculator
    for backend, overrides in (("hf", ("train.use_vllm=true",)), ("unsloth", ("model.fast_inference=true",))):
        plan = rollout_plan(_recipe("data.calculator=true", *overrides), backend, "cuda")
        assert plan.vllm and plan.calculator and not plan.engine and plan.describe() == "vLLM with the calculator"
    assert not rollout_plan(_recipe("data.calculator=true", "model.fast_inference=true"), "hf", "cuda").vllm
    assert rollout_plan(_recipe(), "hf", "cuda").describe() == "TRL's generation"


@pytest.mark.parametrize("overrides", [(), ("model.backend=unsloth",), ("train.use_vllm=true",),
                                       ("train.top_p=1.0", "train.top_k=0", "train.repetition_penalty=1.0")])
def test_the_calculator_is_honoured_on_either_backend_and_with_vllm(overrides):
    recipe = _recipe("data.calculator=true", *overrides)
    for target in (RunTarget("hf", "cpu", ONE), RunTarget("hf", "cuda", ONE), RunTarget("unsloth", "cuda", ONE)):
        check(recipe, target)  # no refusal: plain sampling at the temperature, which the calculator's paths do
    check(_recipe("data.calculator=true", "model.fast_inference=true", *overrides), RunTarget("unsloth", "cuda", ONE))


def test_fast_inference_needs_unsloth_on_cuda():
    recipe = _recipe("model.fast_inference=true")
    check(recipe, RunTarget("unsloth", "cuda", ONE))
    for target in (RunTarget("hf", "cuda", ONE), RunTarget("hf", "cuda", Launch(2)), RunTarget("unsloth", "cpu", ONE)):
        _refused(recipe, target, "model.fast_inference=true", "model.fast_inference=false")
    check(_recipe("model.fast_inference=null"), RunTarget("hf", "cpu", ONE))  # null is off


@pytest.mark.parametrize("setting", ["train.top_p=0.9", "train.top_k=20", "train.min_p=0.1",
                                     "train.repetition_penalty=1.1", "train.generation_kwargs={top_p: 0.9}"])
@pytest.mark.parametrize("backend", ["hf", "unsloth"])
def test_the_calculator_off_vllm_refuses_sampling_settings_beyond_the_temperature(setting, backend):
    key = setting.split("=")[0]
    text = _refused(_recipe("data.calculator=true", setting), RunTarget(backend, "cuda", ONE), "data.calculator", key,
                    "data.calculator=false", f"remove {key}")
    assert "temperature only" in text
    check(_recipe(setting), RunTarget(backend, "cuda", ONE))  # without the calculator TRL samples with it
    # on vLLM the calculator's rounds sample with TRL's own settings
    vllm = ("model.fast_inference=true",) if backend == "unsloth" else ("train.use_vllm=true",)
    check(_recipe("data.calculator=true", setting, *vllm), RunTarget(backend, "cuda", ONE))


def test_the_calculator_on_vllm_refuses_what_its_rounds_cannot_take():
    on = ("data.calculator=true", "train.use_vllm=true")
    _refused(_recipe(*on, "train.vllm_structured_outputs_regex=a+"), RunTarget("hf", "cuda", ONE),
             "train.vllm_structured_outputs_regex", "remove train.vllm_structured_outputs_regex")
    _refused(_recipe(*on, "train.vllm_tensor_parallel_size=2"), RunTarget("hf", "cuda", ONE),
             "train.vllm_tensor_parallel_size=2", "train.vllm_mode=server")
    check(_recipe(*on, "train.vllm_tensor_parallel_size=2", "train.vllm_mode=server"), RunTarget("hf", "cuda", ONE))
    for setting in ("train.vllm_structured_outputs_regex=a+", "train.vllm_tensor_parallel_size=2"):
        check(_recipe("train.use_vllm=true", setting), RunTarget("hf", "cuda", ONE))  # TRL's own vLLM takes them
        check(_recipe("data.calculator=true", setting), RunTarget("hf", "cuda", ONE))  # the engine ignores them


@pytest.mark.parametrize("overrides, named", [
    (("train.stage_eval=10",), ("train.stage_eval=10", "rank 0", "train.stage_eval=0", "ZeRO-2")),
    (("train.eval_every=5",), ("train.eval_every=5", "rank 0", "train.eval_every=0", "ddp.yaml")),
    (("data.calculator=true",), ("data.calculator", "without gathering", "data.calculator=false", "ZeRO-2")),
    (("model.load_in_4bit=true",), ("model.load_in_4bit=true", "model.load_in_4bit=false")),
])
def test_zero3_refuses_what_samples_on_rank_0_or_without_gathering(overrides, named):
    base = ("model.backend=hf", "model.load_in_4bit=false", "train.stage_eval=0")
    recipe = _recipe(*base, *overrides)
    _refused(recipe, RunTarget("hf", "cuda", ZERO3), "ZeRO-3", *named)
    check(recipe, RunTarget("hf", "cuda", ZERO2))  # ZeRO-2 and DDP keep the whole model on every rank
    check(recipe, RunTarget("hf", "cuda", Launch(2)))


def test_zero3_takes_the_calculator_on_vllm():
    """TRL's vLLM gathers the ZeRO-3 shards when it syncs the weights; the calculator's rounds sample on vLLM."""
    check(_recipe("model.backend=hf", "model.load_in_4bit=false", "data.calculator=true", "train.use_vllm=true"),
          RunTarget("hf", "cuda", ZERO3))


def test_zero3_refuses_the_engine_on_cpu_unless_trl_samples():
    recipe = _recipe("train.stage_eval=0")  # the CPU recipe: hf, where the engine samples GRPO's completions
    _refused(recipe, RunTarget("hf", "cpu", ZERO3), "train.sampling_engine=true", "train.sampling_engine=false")
    check(_recipe("train.stage_eval=0", "train.sampling_engine=false"), RunTarget("hf", "cpu", ZERO3))
    check(recipe, RunTarget("hf", "cuda", ZERO3))  # on CUDA TRL's generation samples (it gathers the shards)


def test_the_target_resolves_auto_as_train_would():
    gpu = _recipe(path=GPU_RECIPE)  # backend auto, gpu_memory_gb=8
    assert gpu.model.backend == "auto" and gpu.gpu_memory_gb
    # a GPU recipe only runs on CUDA (train refuses it elsewhere): judged there, without asking this machine
    assert run_target(gpu, ONE, cuda=False).device == "cuda"
    assert run_target(gpu, Launch(2, 3), cuda=False).backend == "hf"  # several processes: hf
    cpu = _recipe("model.backend=auto", "gpu_memory_gb=null", path=GPU_RECIPE)
    assert run_target(cpu, ONE, cuda=False) == RunTarget("hf", "cpu", ONE)
    with pytest.raises(BadInputError, match="model.backend=unsloth under 2 processes"):
        run_target(_recipe("model.backend=unsloth"), Launch(2), cuda=True)


def test_unsloth_fp32_on_cuda_is_refused_before_the_model_loads():
    recipe = _recipe("train.precision=fp32", "model.backend=unsloth")
    _refused(recipe, RunTarget("unsloth", "cuda", ONE), "train.precision=fp32", "model.backend=hf")
    check(recipe, RunTarget("hf", "cuda", ONE))
    check(_recipe("train.precision=fp32"), RunTarget("hf", "cpu", ONE))


def test_the_recipe_rules_count_the_launchers_processes():
    recipe = _recipe("train.per_device_train_batch_size=4", "train.num_generations=8",
                     "train.gradient_accumulation_steps=1")
    check(recipe, RunTarget("hf", "cuda", Launch(2)))  # 4 x 2 processes = 8 completions: one group
    with pytest.raises(RecipeError, match="3 process"):
        check(recipe, RunTarget("hf", "cuda", Launch(3)))


def test_launch_reads_the_launchers_environment_and_train_deepspeed():
    assert launch(environ={}) == ONE
    env = {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ACCELERATE / "ds_zero3.json")}
    assert launch(environ=env) == Launch(2, 3)
    assert launch(environ={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}) == Launch(1, 2)
    # TrainingArguments' own DeepSpeed config (train.deepspeed), under torchrun: a file or a dict
    assert launch({"deepspeed": str(ACCELERATE / "ds_zero3.json")}, environ={"WORLD_SIZE": "4"}) == Launch(4, 3)
    assert launch({"deepspeed": {"zero_optimization": {"stage": 2}}}, environ={}) == Launch(1, 2)
    with pytest.raises(BadInputError, match="train.deepspeed"):
        launch({"deepspeed": str(ACCELERATE / "no-such.json")}, environ={})


def test_an_accelerate_config_becomes_the_environment_accelerate_launch_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped configs name their DeepSpeed JSON relative to the repository root
    assert launch(environ=launcher_environment(ACCELERATE / "zero3.yaml")) == Launch(2, 3)
    assert launch(environ=launcher_environment(ACCELERATE / "zero2.yaml")) == Launch(2, 2)
    assert launch(environ=launcher_environment(ACCELERATE / "ddp.yaml")) == Launch(2)
    keys = tmp_path / "keys.yaml"  # DeepSpeed set by accelerate's own config keys, no JSON
    keys.write_text("distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  zero_stage: 3\n")
    assert launch(environ=launcher_environment(keys)) == Launch(4, 3)
    not_one = tmp_path / "recipe.yaml"
    not_one.write_text("model:\n  name: x\n")
    with pytest.raises(BadInputError, match="not an accelerate config"):
        launcher_environment(not_one)
    with pytest.raises(BadInputError, match="accelerate config"):
        launcher_environment(tmp_path / "missing.yaml")
