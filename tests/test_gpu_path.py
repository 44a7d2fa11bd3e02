"""The CUDA path, checked on a CPU machine: precision from the loaded dtype, the sampling engine, vLLM as
an opt-in, vLLM memory, the eval's mode and RNG, OOM residue, drivers and capabilities.

No GPU is needed and nothing is monkeypatched: each function takes what it would ask the machine (a compute
capability, a CudaFacts, a module table) as an argument, and the models are small fakes or the tiny test model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lowmem_grpo.device import CudaFacts, model_dtype
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import apply_overrides
from lowmem_grpo.runtime import Runtime, auto_dtype, resolve


def gpu(capability=(8, 6)) -> CudaFacts:
    """A CUDA GPU of this compute capability, as lowmem_grpo.device.cuda_facts would describe it."""
    return CudaFacts(torch_cuda="12.6", available=True, capability=capability)


NO_GPU = CudaFacts(torch_cuda=None, available=False)


def runtime(*overrides: str, facts: CudaFacts = NO_GPU) -> Runtime:
    """The Runtime of the default recipe with `overrides` on the machine `facts` describe."""
    return resolve(apply_overrides(Recipe(), list(overrides)), Launch(), facts, environ={})


# --- 1. precision follows the dtype the model was really loaded in -------------------------------


def test_auto_dtype_follows_native_bf16_not_emulation():
    """Turing (sm_75) emulates bf16 and torch.cuda.is_bf16_supported() says True; Unsloth loads float16 there."""
    assert auto_dtype(gpu((7, 5)))[0] == runtime(facts=gpu((7, 5))).dtype == "float16"
    assert auto_dtype(gpu((8, 6)))[0] == runtime(facts=gpu((8, 6))).dtype == "bfloat16"
    from lowmem_grpo.device import cpu_bf16_supported

    # this CPU's own answer when nothing decides it from outside (tests/test_cpu_dtype.py covers the setting)
    assert runtime().dtype == ("bfloat16" if cpu_bf16_supported() else "float32")
    assert runtime("model.dtype=float16", facts=gpu((9, 0))).dtype == "float16"


def _fake_model(dtype, **extra):
    return SimpleNamespace(config=SimpleNamespace(dtype=dtype), **extra)


def test_model_dtype_reads_the_model_as_unsloth_does():
    assert model_dtype(_fake_model(torch.float16)) == "float16"
    assert model_dtype(_fake_model("bfloat16")) == "bfloat16"
    no_config_dtype = SimpleNamespace(config=SimpleNamespace(dtype=None),
                                      get_input_embeddings=lambda: torch.nn.Embedding(2, 2).half())
    assert model_dtype(no_config_dtype) == "float16"
    assert model_dtype(_fake_model(torch.bfloat16, _unsloth_forced_float32=True)) == "float32"  # Gemma 3


def flags(run: Runtime, loaded: str) -> tuple[bool, bool]:
    """(bf16, fp16) once the model was loaded in `loaded`."""
    return run.flags(loaded)


def test_flags_follow_the_loaded_dtype_on_cuda():
    unsloth = runtime("model.backend=unsloth", facts=gpu())
    assert (unsloth.bf16, unsloth.fp16) == (True, False)  # what the resolved dtype asks for, before the load
    assert flags(unsloth, "float16") == (False, True)
    assert flags(unsloth, "bfloat16") == (True, False)
    assert flags(runtime("model.backend=hf", facts=gpu()), "float32") == (False, False)
    assert flags(runtime("model.backend=hf"), "bfloat16") == (False, False)
    assert flags(runtime("model.backend=hf", "train.precision=fp32", facts=gpu()), "bfloat16") == (False, False)


def test_unsloth_cuda_refuses_what_its_trainer_would_raise_on_or_override():
    from lowmem_grpo.combinations import check
    from lowmem_grpo.runtime import check_loaded_dtype, place

    with pytest.raises(BadInputError, match="compute capability below 8"):  # Unsloth: "Model is in float16 ..."
        check_loaded_dtype(runtime("model.backend=unsloth", "train.precision=bf16", facts=gpu()), "float16")
    check_loaded_dtype(runtime("model.backend=unsloth", "train.precision=bf16", facts=gpu()), "bfloat16")
    fp32 = apply_overrides(Recipe(), ["model.backend=unsloth", "train.precision=fp32"])
    with pytest.raises(BadInputError, match="autocast") as info:  # Unsloth turns fp32 into bf16/fp16 AMP
        check(fp32, place(fp32, Launch(), gpu()))
    assert "model.backend=hf" in info.value.fix
    assert flags(runtime("model.backend=unsloth", "train.precision=fp16", facts=gpu()), "float16") == (False, True)


def test_grpo_config_takes_the_loaded_dtype(tmp_path):
    from lowmem_grpo.train.grpo import build_grpo_config

    config = build_grpo_config(Recipe(), tmp_path, runtime("model.backend=hf"), [1.0] * 5, "float16")
    assert (config.bf16, config.fp16) == (False, False)  # CPU: no autocast whatever the weights


# --- 2. the sampling engine: vLLM by its engine, sampling the live adapter -----------------------


class Recorder:
    """Records calls; returns `value`."""

    def __init__(self, value=None):
        self.calls, self.value = [], value

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.value


def test_fast_generate_alone_is_not_vllm():
    from lowmem_grpo.sampling.generate import choose_engine

    unsloth_without_vllm = SimpleNamespace(fast_generate=Recorder())  # Unsloth puts this on every model
    assert choose_engine(unsloth_without_vllm) == "transformers"
    with pytest.raises(BadInputError):
        choose_engine(unsloth_without_vllm, "vllm")


def test_a_vllm_engine_samples_the_live_adapter():
    from lowmem_grpo.sampling.generate import LIVE_ADAPTER, choose_engine, vllm_target

    engine, request = SimpleNamespace(generate=Recorder()), object()
    model = SimpleNamespace(vllm_engine=engine, peft_config={}, load_lora=Recorder(request),
                            fast_generate=engine.generate)
    assert choose_engine(model) == "vllm"
    assert vllm_target(model) == (engine, request)
    assert model.load_lora.calls == [((LIVE_ADAPTER,), {"load_tensors": True})]
    given = object()
    assert vllm_target(model, given) == (engine, given)  # an explicit request (eval's adapter) wins
    base = SimpleNamespace(vllm_engine=engine)  # no adapter: the base weights, no request
    assert vllm_target(base) == (engine, None)


# --- 6. periodic eval: the mode it found, and training's RNG untouched ---------------------------


class UnslothLike(torch.nn.Module):
    """A model with Unsloth's for_inference / for_training whose every next token is EOS (the sampling engine calls
    its forward)."""

    def __init__(self, eos: int):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.eos = eos
        self.calls: list = []
        self._unsloth_gradient_checkpointing = "unsloth"
        self.generation_config = None

    def for_inference(self):
        self.calls.append("for_inference")
        self.training = False

    def for_training(self, use_gradient_checkpointing=None):
        self.calls.append(("for_training", use_gradient_checkpointing))
        self.training = True

    def forward(self, input_ids, past_key_values=None, **_):
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], self.eos + 1)
        logits[..., self.eos] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)  # every model returns its cache


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_eval_puts_an_unsloth_model_back_with_its_checkpointing_mode(tiny_tokenizer):
    from lowmem_grpo.sampling.generate import generate

    model = UnslothLike(tiny_tokenizer.eos_token_id).train()
    out = generate(model, tiny_tokenizer, ["a", "b"], max_new_tokens=4, progress=False, engine="transformers")
    assert [len(samples) for samples in out] == [1, 1]
    assert model.calls == ["for_inference", ("for_training", "unsloth")] and model.training
    model.eval()
    model.calls.clear()
    generate(model, tiny_tokenizer, ["a"], max_new_tokens=4, progress=False)
    assert model.calls == ["for_inference"] and not model.training  # it was not training: it stays so


def test_eval_neither_reseeds_nor_consumes_trainings_random_stream(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.sampling.generate import generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(123)
    first = generate(model, tiny_tokenizer, ["two"], max_new_tokens=6, num_samples=2, temperature=1.0, seed=7,
                     progress=False)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))
    again = generate(model, tiny_tokenizer, ["two"], max_new_tokens=6, num_samples=2, temperature=1.0, seed=7,
                     progress=False)
    assert [g.text for g in first[0]] == [g.text for g in again[0]]  # the seed still makes it repeatable


# --- 3. vLLM is opt-in ---------------------------------------------------------------------------


def test_vllm_is_off_unless_asked_for():
    from lowmem_grpo.memory.plan import settings_for

    recipe = apply_overrides(Recipe(), ["model.backend=unsloth"])
    assert recipe.model.fast_inference is False
    assert settings_for(recipe, 8 * 2**30).fast_inference is False  # whether or not vllm is installed
    assert not runtime("model.backend=unsloth", "model.fast_inference=null", facts=gpu()).fast_inference
    assert runtime("model.backend=unsloth", "model.fast_inference=true", facts=gpu()).fast_inference
    assert not runtime("model.backend=hf", "model.fast_inference=true", facts=gpu()).fast_inference  # check refuses
    on = apply_overrides(recipe, ["model.fast_inference=true"])
    assert settings_for(on, 8 * 2**30).fast_inference is True


# --- 4. vLLM memory and what an OOM retry may change ---------------------------------------------

GIB = 2**30


def _vllm_recipe(*extra: str):
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    return apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), ["model.backend=unsloth", "model.fast_inference=true",
                                                                *extra])


def test_auto_fit_takes_the_vllm_share_of_free_memory_and_never_raises_it():
    """Unsloth reserves u x the memory free at load; auto-fit used to raise u towards 0.95 (of the budget)."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.errors import RecipeError
    from lowmem_grpo.memory.fit import fit_to_device

    recipe = _vllm_recipe("model.gpu_memory_utilization=0.6")

    def card(free_gib: int) -> CudaFacts:
        return CudaFacts(torch_cuda="13.0", available=True, capability=(8, 9), free_bytes=free_gib * GIB,
                         total_bytes=24 * GIB)

    fitted, plan = fit_to_device(recipe, set(), facts=card(8))
    u = fitted.model.gpu_memory_utilization
    assert u <= 0.6 and plan.fits
    assert plan.terms["vllm_reservation"] == int(u * 8 * GIB)
    with pytest.raises(RecipeError):
        fit_to_device(recipe, set(), facts=card(3))  # the share is not raised to squeeze vLLM in
    small_share = _vllm_recipe("model.gpu_memory_utilization=0.2")  # 0.2 x 8 GiB: under weights + 1 GiB
    with pytest.raises(RecipeError, match="gpu_memory_utilization=0.2 gives vLLM") as info:
        fit_to_device(small_share, set(), facts=card(8))
    assert "fast_inference=false" in info.value.fix


def test_oom_retry_never_changes_what_a_loaded_model_cannot_take():
    from lowmem_grpo.train.oom import LOAD_TIME_KEYS, lower, lower_by_planner

    recipe = _vllm_recipe("model.gpu_memory_utilization=0.6", "train.gradient_checkpointing=false")
    for phase in ("update", "generation"):
        lowered = lower_by_planner(recipe, phase)
        if lowered is not None:
            assert not set(lowered.changes) & LOAD_TIME_KEYS, lowered.describe()
        anyway = lower(recipe, phase=phase)
        assert anyway is not None and not set(anyway.changes) & LOAD_TIME_KEYS, anyway.describe()
    assert {"model.gpu_memory_utilization", "lora.r", "train.gradient_checkpointing"} <= LOAD_TIME_KEYS


# --- 8. consumer GPUs and drivers ----------------------------------------------------------------

TORCH_CU130_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")  # torch 2.14.1's PyPI build


def test_an_old_driver_is_named_with_the_driver_that_torch_needs():
    from lowmem_grpo.device import CudaFacts, cuda_problem

    old = CudaFacts(torch_cuda="13.0", available=False, driver_cuda="12.2", driver_version="535.104.05",
                    warnings=("CUDA initialization: The NVIDIA driver on your system is too old "
                              "(found version 12020).",))
    problem, fix = cuda_problem(old)
    assert "too old" in problem and "535.104.05" in problem and "CUDA 13.0" in problem
    assert "580.65.06" in fix and "cu126" in fix
    no_warning = CudaFacts(torch_cuda="13.0", available=False, driver_cuda="12.8")  # older major, no warning seen
    assert "too old" in cuda_problem(no_warning)[0]
    assert "no NVIDIA driver" in cuda_problem(CudaFacts(torch_cuda="13.0", available=False))[0]
    assert cuda_problem(CudaFacts(torch_cuda=None, available=False)) is None  # a CPU build expects no GPU


def test_a_card_older_than_the_build_is_named_by_its_capability():
    from lowmem_grpo.device import CudaFacts, capability_in_build, cuda_problem

    pascal = CudaFacts(torch_cuda="13.0", available=True, capability=(6, 1), arch_list=TORCH_CU130_ARCHS)
    problem, fix = cuda_problem(pascal)
    assert "6.1" in problem and "no kernel image" in problem and "cu126" in fix
    for ok in ((7, 5), (8, 6), (8, 9), (9, 0), (12, 0)):
        assert capability_in_build(ok, TORCH_CU130_ARCHS), ok
    assert not capability_in_build((7, 0), TORCH_CU130_ARCHS)
    ada = CudaFacts(torch_cuda="13.0", available=True, capability=(8, 9), arch_list=TORCH_CU130_ARCHS)
    assert cuda_problem(ada) is None


def test_a_gpu_recipe_stops_without_usable_cuda_unless_cpu_is_asked_for():
    from lowmem_grpo.device import CudaFacts, require_gpu

    pascal = CudaFacts(torch_cuda="13.0", available=True, capability=(6, 1), arch_list=TORCH_CU130_ARCHS)
    with pytest.raises(BadInputError, match="tuned for a 8 GB GPU.*6.1") as info:
        require_gpu(8, pascal)
    assert "gpu_memory_gb=null" in info.value.fix
    require_gpu(None, pascal)  # a CPU recipe, or gpu_memory_gb=null: the user asked for CPU
    with pytest.raises(BadInputError, match="CPU build"):
        require_gpu(8, CudaFacts(torch_cuda=None, available=False))


def test_train_stops_a_gpu_recipe_before_any_data_or_model(tmp_path):
    """Through train() with the facts of a machine whose driver is too old: exit-2 error, nothing written."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), [f"output.dir={tmp_path / 'run'}"])
    old_driver = CudaFacts(torch_cuda="13.0", available=False, driver_cuda="12.4", driver_version="550.54.14")
    with pytest.raises(BadInputError, match="driver is too old"):
        train(recipe, cuda=old_driver)
    assert not (tmp_path / "run").exists()


def test_doctor_names_the_driver_and_the_capability_problem():
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.doctor import report

    pascal = CudaFacts(torch_cuda="13.0", available=True, capability=(6, 1), arch_list=TORCH_CU130_ARCHS,
                       driver_cuda="13.0", driver_version="580.95.05")
    text, problems = report(pascal)
    assert "580.95.05" in text and "capability    6.1" in text
    assert any("6.1" in p for p in problems)
    cpu_machine = CudaFacts(torch_cuda="13.0", available=False)
    text, problems = report(cpu_machine)
    assert "no NVIDIA driver" in text and not any("driver" in p for p in problems)


@pytest.mark.skipif(torch.cuda.is_available(), reason="precondition: this machine has no usable CUDA GPU")
def test_cli_train_of_a_gpu_recipe_exits_2_on_this_cpu_machine(tmp_path):
    from resilience_helpers import cli_inprocess

    code, log = cli_inprocess("train", "recipes/qwen2_5_1_5b_gsm8k.py", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "tuned for a 8 GB GPU" in log and "gpu_memory_gb=null" in log, log[-2000:]
    assert not (tmp_path / "run").exists()


# --- 9. the base an adapter names ----------------------------------------------------------------


def test_the_original_base_replaces_unsloths_prequantized_repo():
    from lowmem_grpo.backends.adapter import original_base

    unsloth_repo = "unsloth/Qwen2.5-1.5B-Instruct-unsloth-bnb-4bit"
    assert original_base(unsloth_repo, "Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert original_base(unsloth_repo, None) == "unsloth/Qwen2.5-1.5B-Instruct"  # Unsloth's 16-bit mirror
    assert original_base("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "embedded:x") == "unsloth/Llama-3.2-1B-Instruct"
    assert original_base("/models/tiny", "Qwen/Qwen2.5-1.5B-Instruct") == "/models/tiny"  # hf runs: as recorded


# --- 11. the export proof judges the merge against the adapter's own effect ----------------------


def test_a_lost_adapter_fails_even_within_the_bf16_tolerance():
    """The issue's numbers: embedded SmolLM2 after 3 steps, max |logit| 43.7, adapter effect 1.6, bf16 tolerance
    max(0.05, 0.1 x 43.7) = 4.4. A lost adapter differs by the whole effect."""
    from lowmem_grpo.export.proof import judge, tolerance_for

    tolerance = tolerance_for("merged-16bit", "bfloat16", 43.7)
    assert tolerance == pytest.approx(4.37)
    assert "lost the adapter" in judge(1.6, tolerance, 1.6, relative=True)
    assert judge(1.25, tolerance, 1.6, relative=True) is not None  # bf16 rounding as large as the adapter
    assert judge(1.1e-4, tolerance_for("merged-16bit", "float32", 43.7), 1.6, relative=True) is None
    assert judge(1.25, 2.0, 1.6, relative=False) is None  # an explicit --tolerance judges absolutely
    assert "above the tolerance" in judge(2.5, 2.0, 10.0, relative=False)


# --- the GPU check script: importable, its arguments and its table (CI never runs it) ------------


def _gpu_check():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # as a script run has it: its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_arguments_and_the_rows_it_plans():
    gpu_check = _gpu_check()
    args = gpu_check.parse_args([])
    assert (args.recipe, args.steps, args.time_budget, args.card_gib) == ("qwen2_5_1_5b_gsm8k", 3, 420, 5.0)
    assert args.variants.split(",") == ["unsloth-4bit", "engine-logits", "unsloth-calc", "gemma3-fastmodel",
                                        "hf-4bit", "hf-4bit-shared", "hf-4bit-unshared", "unsloth-4bit-vllm"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--variants", "unsloth-8bit"])
    rows = gpu_check.planned_rows(args.variants.split(","), vllm_importable=False)
    assert [skip is None for _, skip in rows] == [True] * 7 + [False]
    # the pair differs in the CPU paths' switch only, without the checkpointing that keeps ours off the loss pass
    on, off = (gpu_check.VARIANTS[v].overrides for v in gpu_check.SHARED_PAIR)
    assert [o for o in off if o not in on] == ["train.cpu.fast=false"] and len(on) == len(off)
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    shared, unshared = (apply_overrides(load_recipe(args.recipe), v).train for v in (on, off))
    assert shared.cpu.fast and not unshared.cpu.fast
    assert not shared.gradient_checkpointing and not unshared.gradient_checkpointing
    assert all(skip is None for _, skip in gpu_check.planned_rows(args.variants.split(","), vllm_importable=True))


def test_gpu_check_answers_help_on_cpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--card-gib" in out.stdout and "engine-logits" in out.stdout, out.stderr


def test_gpu_check_variants_are_valid_recipes_that_check_what_they_say(tmp_path):
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_rules import validate

    gpu_check = _gpu_check()
    args = gpu_check.parse_args([])
    recipes = {}
    for name, spec in gpu_check.VARIANTS.items():
        args.worker = name
        recipes[name] = gpu_check.variant_recipe(args, name, tmp_path / "model", tmp_path / "rows.jsonl",
                                                 tmp_path / name)
        validate(recipes[name])
        assert recipes[name].train.max_steps == (spec.steps or 3)
    first = recipes["unsloth-4bit"].train  # the preflight on, random rewards allowed, a stage evaluation after GRPO
    assert first.preflight.enabled and first.preflight.allow_no_signal and first.eval.stage.problems
    assert first.eval.stage.stages == ["trained"]
    calc = recipes["unsloth-calc"]
    assert calc.data.calculator and calc.model.backend == "unsloth" and calc.train.max_completion_length == 24
    assert calc.train.max_steps == 2 and recipes["gemma3-fastmodel"].model.name == str(tmp_path / "model")
    assert gpu_check.VARIANTS["gemma3-fastmodel"].recipe == "gemma3_1b_gsm8k"
    # on the default card the plan cuts the evaluation batch, and the stage evaluation holds one planned batch
    real = gpu_check.variant_recipe(args, "unsloth-4bit", "Qwen/Qwen2.5-1.5B-Instruct", tmp_path / "rows.jsonl",
                                    tmp_path / "run")
    p = plan(real, int(args.card_gib * GIB))
    assert p.fits and p.eval_batch == real.train.eval.stage.problems == 64 < 128


class FakeMemory:
    """Stands in for torch.cuda's peak statistics (gpu_check.CudaMemory: reset, peak, used)."""

    def __init__(self, peaks):
        self.peaks, self.resets = list(peaks), 0

    def reset(self):
        self.resets += 1

    def peak(self):
        return self.peaks.pop(0)

    def used(self):
        return 7


def test_gpu_check_probe_splits_the_run_around_grpo():
    gpu_check = _gpu_check()
    probe = gpu_check.PhaseProbe(FakeMemory([3, 5, 2]))
    probe.start()
    for event in ("on_init_end", "on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_train_end"):
        getattr(probe, event)(None, None, None, logs={"loss": 0.5})  # every TrainerCallback event answers
    probe.finish()
    assert probe.peaks == {"before_grpo": 3, "before_grpo_device": 7, "grpo": 5, "grpo_device": 7, "after_grpo": 2,
                           "after_grpo_device": 7}
    assert probe.memory.resets == 4 and probe.steps == 1 and probe.logs == [{"loss": 0.5}]
    with pytest.raises(AttributeError):
        probe.not_an_event  # noqa: B018


def test_gpu_check_compares_the_evaluation_with_the_plan(tmp_path):
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    gpu_check = _gpu_check()
    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), [*gpu_check.UNSLOTH, *gpu_check.PLANNED_EVAL])
    saved = plan(recipe, 5 * GIB).to_dict()  # what the run's memory_plan.json holds
    phases = gpu_check.predicted_phases(saved)
    resident = saved["allocated_bytes"] - saved["phases"][saved["peak_phase"]]
    assert phases["evaluation"] == resident + saved["phases"]["evaluation"] == saved["allocated_bytes"]
    assert phases["grpo"] == resident + max(saved["phases"]["generation"], saved["phases"]["training"])
    check = gpu_check.evaluation_check(saved, 64, 64, {"after_grpo": 3 * GIB})
    assert check["batch_agrees"] and check["planned_batch"] == 64 and check["measured_eval_allocated"] == 3 * GIB
    assert not gpu_check.evaluation_check(saved, 64, 128, {})["batch_agrees"]
    result = {"variant": "unsloth-4bit", "card_gib": 5.0, "evaluation": check, "predicted_phases": phases,
              "before_grpo": 2 * GIB}
    text = gpu_check.report([result])
    line = next(ln for ln in text.splitlines() if ln.startswith("unsloth-4bit") and " 64 " in ln)
    assert line.split()[1:6] == ["5", "64", "64", "64", "yes"] and "3.00" in line


def test_gpu_check_prints_the_engine_and_calculator_results():
    gpu_check = _gpu_check()
    family = {"model_class": "LlamaForCausalLM", "dtype": "bfloat16", "tokens_match": True, "forced_match": True,
              "forced_tokens": 3, "lengths": [3, 24, 1, 11, 3], "max_logit_diff": 0.03, "context_effect": 3.9,
              "tolerance": 0.5, "ok": True}
    results = [{"variant": "engine-logits", "families": {"llama": family, "gemma3_text": {"error": "ValueError: x"}}},
               {"variant": "unsloth-calc", "steps": 2, "completions": 32, "calculator_fired": 32,
                "losses": [0.0, 0.01], "max_allocated": GIB}]
    text = gpu_check.report(results)
    assert "llama" in text and "3/24/1/11/3" in text and " ok" in text and "gemma3_text  ValueError: x" in text
    assert "2 steps, the calculator completed 32 of 32 recorded rollouts" in text
    assert "variant" in text.splitlines()[0]  # the GRPO table lists neither: they have no plan to compare


def test_gpu_check_table_shows_memory_speed_and_phase_timings():
    gpu_check = _gpu_check()
    logs = [{"stage": "prime", "step": 1, "step_time": 9.0},
            {"stage": "grpo", "step": 1, "step_time": 10.0, "completions/mean_length": 256, "time/generation": 8.0},
            {"stage": "grpo", "step": 2, "step_time": 4.0, "completions/mean_length": 256, "time/generation": 2.0,
             "time/update": 1.5},
            {"stage": "grpo", "step": 3, "step_time": 6.0, "completions/mean_length": 256, "time/generation": 4.0,
             "time/update": 1.5}]
    assert gpu_check.phase_times(logs) == {"time/generation": 3.0, "time/update": 1.5}  # the first step compiles
    assert gpu_check.speed(logs, 16) == {"step_s": 5.0, "tokens_per_s": round((4096 / 2 + 4096 / 4) / 2, 1)}
    assert gpu_check.speed([], 16) == {"step_s": None, "tokens_per_s": None}
    results = [{"variant": "unsloth-4bit", "steps": 3, "predicted_allocated": 3 * GIB, "max_allocated": 2.5 * GIB,
                "predicted_total": 3.5 * GIB, "device_used": 4 * GIB, "tokens_per_s": 1536.0, "step_s": 5.0,
                "phases": {"time/generation": 3.0}},
               {"variant": "unsloth-4bit-vllm", "skipped": gpu_check.NO_VLLM},
               {"variant": "hf-4bit", "error": "OutOfMemoryError: CUDA out of memory"}]
    text = gpu_check.table(results)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["variant", "steps", "pred"] and "time/generation" in lines[0]
    assert "3.00" in lines[1] and "2.50" in lines[1] and "+20.0%" in lines[1] and "1536.0" in lines[1]
    assert "vllm does not import" in lines[2] and "OutOfMemoryError" in lines[3]
    assert gpu_check.sharing_table(results) == ""  # the pair did not both run


def test_gpu_check_compares_the_shared_prompt_pass_on_and_off():
    gpu_check = _gpu_check()
    on = {"variant": "hf-4bit-shared", "steps": 3, "predicted_allocated_shared": 4 * GIB, "max_allocated": 3 * GIB,
          "step_s": 6.0, "phases": {"time/loss_forward": 1.0, "time/backward": 2.0},
          "prompt_sharing": {"reason": "our shared-prompt pass runs"}}
    off = {"variant": "hf-4bit-unshared", "steps": 3, "predicted_allocated_unshared": 5 * GIB,
           "max_allocated": 4 * GIB, "step_s": 8.0, "phases": {"time/loss_forward": 2.0, "time/backward": 4.0}}
    lines = gpu_check.sharing_table([on, off]).splitlines()
    assert "our shared-prompt pass runs" in lines[0] and lines[1].split() == ["on", "off", "on/off"]
    assert lines[2].split() == ["max", "alloc", "GiB", "3.00", "4.00", "0.75"]
    assert lines[3].split()[-3:] == ["4.00", "5.00", "0.80"]
    assert lines[4].split() == ["time/loss_forward", "s", "1.0", "2.0", "0.50"]
    assert lines[5].split() == ["time/backward", "s", "2.0", "4.0", "0.50"]
    assert lines[6].split() == ["s/step", "6.0", "8.0", "0.75"]
    assert gpu_check.sharing_table([on, {**off, "error": "OutOfMemoryError"}]) == ""
    # the predictions it compares: the planner's allocated bytes with the pass engaged and not
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    predicted = plan(apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), gpu_check.VARIANTS["hf-4bit-shared"].overrides),
                     80 * GIB)
    both = gpu_check.predicted_sharing(predicted)
    assert both["predicted_allocated_unshared"] == predicted.allocated_bytes > both["predicted_allocated_shared"]


# --- the scripted model: the engine against a reference decoder, run here on CPU transformers --------------------


def _benchmark(name):
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The scripted llama of tests/scripted_model.py, built and loaded in bfloat16 on CPU, and its tokenizer."""
    import scripted_model as sm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = sm.build_scripted_model("llama", tmp_path_factory.mktemp("scripted") / "llama")
    return sm, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), AutoTokenizer.from_pretrained(folder)


class CacheLosing:
    """The model behind a decode loop that loses its cache: every one-token step sees only its own token (its position
    kept). generate (the reference) and whole-prompt forwards reach the model as they are."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        if kwargs.get("past_key_values") is not None and kwargs["input_ids"].shape[1] == 1:
            kwargs = {"input_ids": kwargs["input_ids"], "position_ids": kwargs["position_ids"]}
        return self.model(**kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_engine_matches_generate_on_the_scripted_model_and_a_lost_cache_does_not(scripted):
    """What gpu_check's engine-logits runs on Unsloth, on transformers: rows that end at EOS after 3 and 1 tokens, one
    that runs out, one where the calculator forces 42>>; the engine's tokens, forced tokens and logits are generate's
    (with CalculatorForcing), and the context moves the logits by far more than the tolerance."""
    sm, model, tokenizer = scripted
    result = sm.compare(model, tokenizer, max_new_tokens=24)
    assert result["ok"], result
    assert result["lengths"] == result["reference_lengths"] == [3, 24, 1, 11, 3]
    assert result["truncated"] == [False, True, False, False, False] and result["forced_tokens"] == 3
    assert result["texts"][3] == "<<7*6=42>>w2w3" and result["max_logit_diff"] <= 0.5 < result["context_effect"] / 4
    broken = sm.compare(CacheLosing(model), tokenizer, max_new_tokens=24)
    assert not broken["ok"] and broken["max_logit_diff"] > 0.5


def test_a_chat_prompt_makes_every_scripted_rollout_call_the_calculator(scripted, tmp_path):
    """unsloth-calc's premise: the training rows, rendered as chat prompts, end in "assistant", after which the script
    writes <<7*6= and the engine completes it."""
    import json

    from lowmem_grpo.sampling.engine import Calculator, sample_rows

    sm, model, tokenizer = scripted
    rows = [json.loads(line) for line in sm.write_rows(tmp_path / "rows.jsonl", count=3).read_text().splitlines()]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=True,
                                             add_generation_prompt=True) for r in rows]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    assert all(tokenizer.convert_ids_to_tokens(p[-1]) == "assistant" and tokenizer.unk_token_id not in p
               for p in prompts)
    out = sample_rows(model, prompts, max_new_tokens=24, temperature=0.0, eos_ids={tokenizer.eos_token_id},
                      pad_id=tokenizer.pad_token_id, calculator=Calculator(tokenizer))
    texts = [tokenizer.decode(r.ids, skip_special_tokens=True) for r in out]
    assert texts == ["w1<<7*6=42>>w2w3"] * 3 and all(not r.truncated and sum(r.forced) == 3 for r in out)
    assert _gpu_check().CALC_MARK in texts[0]


def test_engine_calls_map_back_to_their_rows():
    import scripted_model as sm

    # 4 rows of 1, 5, 2 and 5 tokens: the engine drops the ended ones once a quarter of the batch has ended
    assert sm.rows_of_calls([4, 4, 2, 2, 2], [1, 5, 2, 5]) == [[0, 1, 2, 3]] * 2 + [[1, 3]] * 3
    logits = [torch.full((4, 2), 0.0), torch.full((4, 2), 1.0), torch.tensor([[2.0] * 2, [3.0] * 2])]
    per_row = sm.engine_logits(logits, [1, 3, 2, 3])
    assert [len(r) for r in per_row] == [1, 3, 2, 3] and float(per_row[1][2][0]) == 2.0
    assert float(per_row[3][2][0]) == 3.0 and float(per_row[2][1][0]) == 1.0
    with pytest.raises(ValueError, match="still writing"):
        sm.rows_of_calls([4, 3], [1, 1, 5, 5])
