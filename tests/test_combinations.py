"""lowmem_grpo.combinations: the combinations `check` refuses before any model loads, on the Runtime a run resolves
to (lowmem_grpo.runtime: the backend `auto` becomes, how GRPO samples); the CLI's side, exit codes and what
validate imports, is in tests/test_validate.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowmem_grpo.combinations import check
from lowmem_grpo.device import CudaFacts
from lowmem_grpo.distributed import Launch, launch, launcher_environment
from lowmem_grpo.errors import BadInputError, RecipeError
from lowmem_grpo.recipe_io import apply_overrides, load_recipe
from lowmem_grpo.runtime import Runtime, resolve, rollout_plan

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
GPU_RECIPE = str(REPO / "recipes" / "qwen2_5_1_5b_gsm8k.py")
ACCELERATE = REPO / "recipes" / "accelerate"
ONE, ZERO3, ZERO2 = Launch(), Launch(2, 3), Launch(2, 2)
GPU = CudaFacts(torch_cuda="12.6", available=True, capability=(8, 6))
NO_GPU = CudaFacts(torch_cuda=None, available=False)


def _recipe(*overrides: str, path: str = CPU_RECIPE):
    return load_recipe(path, list(overrides))


def _target(recipe, backend: str, device: str, launch: Launch = ONE) -> Runtime:
    """The Runtime of `recipe` on `backend` and `device` (a GPU recipe resolves for CUDA either way)."""
    return resolve(apply_overrides(recipe, [f"model.backend={backend}"]), launch, GPU if device == "cuda" else NO_GPU)


def _check(recipe, where: tuple) -> None:
    check(recipe, _target(recipe, *where))


def _refused(recipe, where: tuple, *named: str) -> str:
    with pytest.raises(BadInputError) as caught:
        check(recipe, _target(recipe, *where))
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
    assert not rollout_plan(_recipe("train.cpu.fast=false"), "hf", "cpu").engine
    assert not rollout_plan(_recipe("train.top_p=0.9"), "hf", "cpu").engine  # sampling the engine does not do
    for backend, device in (("hf", "cuda"), ("hf", "cpu"), ("unsloth", "cuda")):
        on = rollout_plan(_recipe("data.calculator=true"), backend, device)
        assert on.engine and on.calculator  # the calculator samples through the engine on either backend
    assert rollout_plan(_recipe("data.calculator=true", "train.cpu.fast=false"), "hf", "cpu").calculator
    for backend, overrides in (("hf", ("train.use_vllm=true",)), ("unsloth", ("model.fast_inference=true",))):
        plan = rollout_plan(_recipe("data.calculator=true", *overrides), backend, "cuda")
        assert plan.vllm and plan.calculator and not plan.engine and plan.describe() == "vLLM with the calculator"
    assert not rollout_plan(_recipe("data.calculator=true", "model.fast_inference=true"), "hf", "cuda").vllm
    assert rollout_plan(_recipe(), "hf", "cuda").describe() == "TRL's generation"


@pytest.mark.parametrize("overrides", [(), ("model.backend=unsloth",), ("train.use_vllm=true",),
                                       ("train.top_p=1.0", "train.top_k=0", "train.repetition_penalty=1.0")])
def test_the_calculator_is_honoured_on_either_backend_and_with_vllm(overrides):
    recipe = _recipe("data.calculator=true", *overrides)
    for target in (("hf", "cpu", ONE), ("hf", "cuda", ONE), ("unsloth", "cuda", ONE)):
        _check(recipe, target)  # no refusal: plain sampling at the temperature, which the calculator's paths do
    _check(_recipe("data.calculator=true", "model.fast_inference=true", *overrides), ("unsloth", "cuda", ONE))


def test_fast_inference_needs_unsloth_on_cuda():
    recipe = _recipe("model.fast_inference=true")
    _check(recipe, ("unsloth", "cuda", ONE))
    for target in (("hf", "cuda", ONE), ("hf", "cuda", Launch(2)), ("unsloth", "cpu", ONE)):
        _refused(recipe, target, "model.fast_inference=true", "model.fast_inference=false")
    _check(_recipe("model.fast_inference=null"), ("hf", "cpu", ONE))  # null is off


@pytest.mark.parametrize("setting", ["train.top_p=0.9", "train.top_k=20", "train.min_p=0.1",
                                     "train.repetition_penalty=1.1", "train.generation_kwargs={top_p: 0.9}"])
@pytest.mark.parametrize("backend", ["hf", "unsloth"])
def test_the_calculator_off_vllm_refuses_sampling_settings_beyond_the_temperature(setting, backend):
    key = setting.split("=")[0]
    text = _refused(_recipe("data.calculator=true", setting), (backend, "cuda", ONE), "data.calculator", key,
                    "data.calculator=false", f"remove {key}")
    assert "temperature only" in text
    _check(_recipe(setting), (backend, "cuda", ONE))  # without the calculator TRL samples with it
    # on vLLM the calculator's rounds sample with TRL's own settings
    vllm = ("model.fast_inference=true",) if backend == "unsloth" else ("train.use_vllm=true",)
    _check(_recipe("data.calculator=true", setting, *vllm), (backend, "cuda", ONE))


def test_the_calculator_on_vllm_refuses_what_its_rounds_cannot_take():
    on = ("data.calculator=true", "train.use_vllm=true")
    _refused(_recipe(*on, "train.vllm_structured_outputs_regex=a+"), ("hf", "cuda", ONE),
             "train.vllm_structured_outputs_regex", "remove train.vllm_structured_outputs_regex")
    _refused(_recipe(*on, "train.vllm_tensor_parallel_size=2"), ("hf", "cuda", ONE),
             "train.vllm_tensor_parallel_size=2", "set train.vllm_tensor_parallel_size=1")


def test_the_calculator_over_vllms_server_mode_is_retired_with_a_named_error():
    from lowmem_grpo.errors import RetiredSettingError

    with pytest.raises(RetiredSettingError, match="train.vllm_mode=server: the calculator over TRL's vLLM server "
                                                  "mode was retired") as info:
        _check(_recipe("data.calculator=true", "train.use_vllm=true", "train.vllm_mode=server"), ("hf", "cuda", ONE))
    assert "train.vllm_mode=colocate" in info.value.fix and info.value.exit_code == 2
    _check(_recipe("train.use_vllm=true", "train.vllm_mode=server"), ("hf", "cuda", ONE))  # TRL's own server mode
    for setting in ("train.vllm_structured_outputs_regex=a+", "train.vllm_tensor_parallel_size=2"):
        _check(_recipe("train.use_vllm=true", setting), ("hf", "cuda", ONE))  # TRL's own vLLM takes them
        _check(_recipe("data.calculator=true", setting), ("hf", "cuda", ONE))  # the engine ignores them


@pytest.mark.parametrize("overrides", [(), ("model.backend=hf", "model.load_in_4bit=false"),
                                       ("model.backend=unsloth",)])
def test_zero3_is_retired_with_a_named_error_and_zero2_and_ddp_run(overrides):
    from lowmem_grpo.errors import RetiredSettingError

    recipe = _recipe(*overrides, "train.eval.stage.problems=0", path=GPU_RECIPE)
    for backend, device in (("hf", "cuda"), ("hf", "cpu")):
        with pytest.raises(RetiredSettingError, match="DeepSpeed ZeRO-3 .* was retired") as info:
            _check(recipe, (backend, device, ZERO3))
        assert "zero2.yaml" in info.value.fix and info.value.exit_code == 2
    _check(recipe, ("hf", "cuda", ZERO2))  # ZeRO-2 and DDP keep the whole model on every rank
    _check(recipe, ("hf", "cuda", Launch(2)))


def test_the_runtime_resolves_auto_as_train_would():
    gpu = _recipe(path=GPU_RECIPE)  # backend auto, gpu_memory_gb=8
    assert gpu.model.backend == "auto" and gpu.gpu_memory_gb
    # a GPU recipe only runs on CUDA (train refuses it elsewhere): judged there, without asking this machine
    assert resolve(gpu, ONE, NO_GPU).device == "cuda"
    assert resolve(gpu, Launch(2, 3), NO_GPU).backend == "hf"  # several processes: hf
    assert resolve(gpu, Launch(2), GPU).backend == "hf"  # auto picks Unsloth for one process only
    cpu = _recipe("model.backend=auto", "gpu_memory_gb=null", path=GPU_RECIPE)
    on_cpu = resolve(cpu, ONE, NO_GPU)
    assert (on_cpu.backend, on_cpu.device, on_cpu.trainer, on_cpu.launch) == ("hf", "cpu", "cpu", ONE)


def test_unsloth_runs_under_ddp_and_zero2():
    """Unsloth 2026.10.9 loads each rank on its own GPU and averages the LoRA gradients itself (DDP, ZeRO-1/2:
    every rank holds the whole model)."""
    unsloth = _recipe("model.backend=unsloth", path=GPU_RECIPE)
    for launch_ in (Launch(2), ZERO2, Launch(4, 1)):
        target = resolve(unsloth, launch_, GPU)
        assert target.backend == "unsloth" and target.processes == launch_.num_processes
    assert resolve(_recipe(path=GPU_RECIPE), Launch(2, 2), GPU).backend == "hf"  # auto under several processes: hf


def test_unsloth_fp32_on_cuda_is_refused_before_the_model_loads():
    recipe = _recipe("train.precision=fp32", "model.backend=unsloth")
    _refused(recipe, ("unsloth", "cuda", ONE), "train.precision=fp32", "model.backend=hf")
    _check(recipe, ("hf", "cuda", ONE))
    _check(_recipe("train.precision=fp32"), ("hf", "cpu", ONE))


def test_the_recipe_rules_count_the_launchers_processes():
    recipe = _recipe("train.per_device_train_batch_size=4", "train.num_generations=8",
                     "train.gradient_accumulation_steps=1")
    _check(recipe, ("hf", "cuda", Launch(2)))  # 4 x 2 processes = 8 completions: one group
    with pytest.raises(RecipeError, match="3 process"):
        _check(recipe, ("hf", "cuda", Launch(3)))


def test_launch_reads_the_launchers_environment_and_train_deepspeed(tmp_path):
    assert launch(environ={}) == ONE
    ds_zero3 = tmp_path / "ds_zero3.json"  # a user's stage-3 config: read so that it can be refused
    ds_zero3.write_text('{"zero_optimization": {"stage": 3}}')
    env = {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_zero3)}
    assert launch(environ=env) == Launch(2, 3)
    assert launch(environ={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}) == Launch(1, 2)
    # TrainingArguments' own DeepSpeed config (train.deepspeed), under torchrun: a file or a dict
    assert launch({"deepspeed": str(ACCELERATE / "ds_zero2.json")}, environ={"WORLD_SIZE": "4"}) == Launch(4, 2)
    assert launch({"deepspeed": {"zero_optimization": {"stage": 2}}}, environ={}) == Launch(1, 2)
    with pytest.raises(BadInputError, match="train.deepspeed"):
        launch({"deepspeed": str(ACCELERATE / "no-such.json")}, environ={})


def test_an_accelerate_config_becomes_the_environment_accelerate_launch_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped configs name their DeepSpeed JSON relative to the repository root
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
