"""The CUDA path, checked on a CPU machine: precision from the loaded dtype, the sampling engine, vLLM's auto
choice, vLLM memory, the eval's mode and RNG, OOM residue, drivers and capabilities.

No GPU is needed and nothing is monkeypatched: each function takes what it would ask the machine (a compute
capability, a CudaFacts, a module table) as an argument, and the models are small fakes or the tiny test model.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowmem_grpo.device import CudaFacts, model_dtype
from lowmem_grpo.distributed import Launch
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import apply_overrides
from lowmem_grpo.runtime import Runtime, auto_dtype, resolve
from scripts import load_script


def gpu(capability=(8, 6)) -> CudaFacts:
    """A CUDA GPU of this compute capability, as lowmem_grpo.device.cuda_facts would describe it."""
    return CudaFacts(torch_cuda="12.6", available=True, capability=capability)


NO_GPU = CudaFacts(torch_cuda=None, available=False)
GIB = 2**30


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


# --- 3. vLLM: model.fast_inference=auto, decided from what is installed and the memory plan's room ---------


def _choice(*overrides: str, backend="unsloth", device="cuda", processes=1, vllm_problem=None, room=True):
    from lowmem_grpo.runtime import choose_fast_inference

    recipe = apply_overrides(Recipe(), list(overrides))
    return choose_fast_inference(recipe, backend, device, processes, vllm_problem=vllm_problem, room=room)


NOT_INSTALLED = "vLLM is not installed (the `vllm` extra)"


def test_auto_turns_vllm_on_where_it_is_installed_and_the_plan_has_room():
    assert Recipe().model.fast_inference == "auto"
    on = _choice()
    assert on.on and on.reason == "auto: vLLM is installed and the memory plan fits its pool beside training"
    assert _choice(room=None).on and "checked when training starts" in _choice(room=None).reason
    for off, why in [(_choice(room=False), "no room for vLLM's pool"),
                     (_choice(vllm_problem=NOT_INSTALLED), NOT_INSTALLED),
                     (_choice(backend="hf"), "this run is hf on cuda"),
                     (_choice(device="cpu"), "this run is unsloth on cpu"),
                     (_choice(processes=2), "2 processes"),
                     (_choice("train.use_vllm=true"), "train.use_vllm"),
                     (_choice("train.vllm_sampling=true"), "train.vllm_sampling")]:
        assert not off.on and why in off.reason, off
    # an explicit value is the user's: true runs on Unsloth on CUDA (doctor names a vLLM that cannot), false is off
    assert _choice("model.fast_inference=true", vllm_problem=NOT_INSTALLED, room=False).on
    assert not _choice("model.fast_inference=true", backend="hf").on  # combinations.check refuses it
    for value in ("false", "null"):
        assert _choice(f"model.fast_inference={value}").reason == f"model.fast_inference={value}"
        assert not _choice(f"model.fast_inference={value}").on


def test_vllm_problem_names_what_keeps_unsloth_from_using_the_installed_vllm():
    from lowmem_grpo.device import vllm_problem

    assert vllm_problem(None, bnb_plugin=False, load_in_4bit=True) == NOT_INSTALLED
    assert "CPU build" in vllm_problem(("0.31.0", "cpu"), bnb_plugin=True, load_in_4bit=False)
    assert "outside the supported 0.21.0-0.31.0" in vllm_problem(("0.33.0", "cuda"), bnb_plugin=True,
                                                                  load_in_4bit=False)
    assert "vllm-bnb-plugin" in vllm_problem(("0.31.0", "cuda"), bnb_plugin=False, load_in_4bit=True)
    assert vllm_problem(("0.31.0", "cuda"), bnb_plugin=True, load_in_4bit=True) is None
    assert vllm_problem(("0.31.0", "cuda"), bnb_plugin=False, load_in_4bit=False) is None
    assert vllm_problem(("0.27.1", "cuda"), bnb_plugin=False, load_in_4bit=True) is None  # bitsandbytes in tree
    assert "unknown" in vllm_problem(("?", "cuda"), bnb_plugin=True, load_in_4bit=True)


def test_the_runtime_resolves_auto_from_this_environment_and_settles_it_into_the_recipe():
    """resolve asks this environment (installed_vllm_problem) and the room it is given, nothing else: on a GPU the
    answer follows whether a usable vLLM is installed here; the settled recipe holds a bool from then on."""
    from lowmem_grpo.device import installed_vllm_problem
    from lowmem_grpo.memory.plan import settings_for
    from lowmem_grpo.recipe_io import dump_yaml, load_recipe
    from lowmem_grpo.runtime import settle_fast_inference

    usable = installed_vllm_problem(True) is None
    cpu = runtime()
    assert not cpu.fast_inference and "this run is hf on cpu" in cpu.fast_inference_reason
    assert "fast inference    off (auto: Unsloth's vLLM runs on the unsloth backend on CUDA" in cpu.block(Recipe())
    recipe = load_recipe("qwen2_5_1_5b_gsm8k", ["model.backend=unsloth"])
    on_gpu = resolve(recipe, Launch(), gpu(), environ={})
    assert on_gpu.fast_inference is usable and on_gpu.fast_inference_reason == _choice(
        "model.backend=unsloth", vllm_problem=installed_vllm_problem(True), room=None).reason
    assert settings_for(recipe, 8 * 2**30).fast_inference is usable  # the plan of an auto recipe, room unknown
    for room in (False, True):
        run = resolve(recipe, Launch(), gpu(), environ={}, vllm_room=room)
        settled = settle_fast_inference(recipe, run)
        assert settled.model.fast_inference is run.fast_inference is (usable and room)
        assert f"fast_inference: {str(usable and room).lower()}" in dump_yaml(settled)  # what recipe.yaml keeps
        assert settle_fast_inference(settled, on_gpu) is settled  # settled once
    assert recipe.model.fast_inference == "auto"  # the caller's recipe is left as it was


def test_vllm_room_is_the_plan_fitting_vllms_pool_without_lowering_training():
    """The shipped qwen2.5-1.5B recipe on cards of a given size (free = total - 0.6 GiB): the plan fits vLLM's pool
    (0.6 of the free memory) beside training on its 8 GB card; qwen3-4B does not on 12 GB (auto-fit would have to
    lower its batch) but does on its 24 GB card; nothing fits 3 GB."""
    from lowmem_grpo.memory.fit import vllm_room
    from lowmem_grpo.recipe_io import load_recipe

    def card(gib: float) -> CudaFacts:
        return CudaFacts(torch_cuda="13.0", available=True, capability=(8, 9), free_bytes=int((gib - 0.6) * GIB),
                         total_bytes=int(gib * GIB))

    qwen = load_recipe("qwen2_5_1_5b_gsm8k", ["model.backend=unsloth"])
    qwen3 = load_recipe("qwen3_4b_gsm8k", ["model.backend=unsloth"])
    assert vllm_room(qwen, set(), facts=card(8)) and not vllm_room(qwen, set(), facts=card(3))
    assert not vllm_room(qwen3, set(), facts=card(12)) and vllm_room(qwen3, set(), facts=card(24))
    assert not vllm_room(qwen, set(), facts=NO_GPU)
    fixed = load_recipe("qwen2_5_1_5b_gsm8k", ["model.backend=unsloth", "train.memory.auto_fit=false"])
    assert vllm_room(fixed, set(), facts=card(8)) and not vllm_room(fixed, set(), facts=card(4))


def test_start_asks_the_plan_for_vllms_room_only_where_auto_could_turn_it_on():
    """backends.start resolves the Runtime once, asking the plan for vLLM's room only where model.fast_inference=auto
    would turn it on (resolve takes the answer: the test above); an hf run on a GPU and an explicit value never ask.
    pipeline.settle_vllm writes the choice into the recipe. (The unsloth backend is not started here: its import
    patches trl and transformers for the rest of the process.)"""
    from lowmem_grpo.backends import start
    from lowmem_grpo.train.pipeline import settle_vllm

    asked = []

    def room(facts: CudaFacts) -> bool:
        asked.append(facts)
        return False

    hf = apply_overrides(Recipe(), ["model.name=nobody/no-such-model", "model.backend=hf"])
    run, _ = start(hf, Launch(), gpu(), vllm_room=room)
    assert asked == [] and not run.fast_inference and f"hf on {run.device}" in run.fast_inference_reason
    assert settle_vllm(hf, run).model.fast_inference is False
    explicit = apply_overrides(hf, ["model.fast_inference=false"])
    assert settle_vllm(explicit, start(explicit, Launch(), gpu(), vllm_room=room)[0]) is explicit and asked == []


# --- 4. vLLM memory and what an OOM retry may change ---------------------------------------------


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
    max(0.05, 0.1 x 43.7) = 4.4. A lost adapter differs by the whole effect (a GGUF file against the merged model);
    a merged export that lost it carries none of the effect: an error of 1."""
    from lowmem_grpo.export.proof import judge, judge_effect, tolerance_for

    tolerance = tolerance_for("bfloat16", 43.7)
    assert tolerance == pytest.approx(4.37)
    assert "lost the adapter" in judge(1.6, tolerance, 1.6, relative=True)
    assert judge(1.25, tolerance, 1.6, relative=True) is not None  # bf16 rounding as large as the adapter
    assert judge(1.1e-4, tolerance_for("float32", 43.7), 1.6, relative=True) is None
    assert judge(1.25, 2.0, 1.6, relative=False) is None  # an explicit --tolerance judges absolutely
    assert "above the tolerance" in judge(2.5, 2.0, 10.0, relative=False)
    assert "lost the adapter" in judge_effect({"kept": 0.0, "error": 1.0})
    assert judge_effect({"kept": 0.97, "error": 0.09}) is None


# --- the GPU check script: importable, its arguments and its table (CI never runs it) ------------


def _gpu_check():
    return _benchmark("gpu_check")


def test_gpu_check_arguments_and_the_checks_it_plans():
    gpu_check = _gpu_check()
    args = gpu_check.parse_args([])
    assert (args.recipe, args.steps, args.time_budget, args.card_gib, args.max_completion_length) == (
        "qwen2_5_1_5b_gsm8k", 2, 420, None, 0)
    assert args.variants.split(",") == ["qwen2_5_1_5b_gsm8k", "engine-logits", "gemma3_1b_gsm8k"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--variants", "unsloth-8bit"])
    checks = gpu_check.plan_checks(gpu_check.parse_args(["--variants", "engine-logits,unsloth-4bit-vllm"]), False)
    assert [c.skipped for c in checks] == [None, gpu_check.NO_VLLM] and checks[1].seconds == 0
    assert not gpu_check.plan_checks(gpu_check.parse_args(["--variants", "unsloth-4bit-vllm"]), True)[0].skipped
    # every shipped recipe with a GPU memory figure is a check of its own name
    from lowmem_grpo.recipe_io import load_recipe, shipped_recipes

    assert set(gpu_check.GPU_RECIPES) == {p.stem for p in shipped_recipes() if load_recipe(str(p)).gpu_memory_gb}
    assert all(gpu_check.VARIANTS[name].recipe == name and gpu_check.VARIANTS[name].card
               for name in gpu_check.GPU_RECIPES)


def test_gpu_check_default_checks_fit_the_budget_with_room_to_spare():
    """The planned seconds of the default checks stay within (1 - MARGIN) of the default --time-budget; they come
    from the time model (a bigger model, a longer completion, more steps plan longer), not from constants."""
    gpu_check = _gpu_check()
    args = gpu_check.parse_args([])
    checks = gpu_check.plan_checks(args, vllm_importable=False)
    planned = {c.variant: round(c.seconds) for c in checks}
    assert [c.variant for c in checks] == gpu_check.DEFAULT_VARIANTS and all(c.seconds > 0 for c in checks)
    assert sum(c.seconds for c in checks) <= (1 - gpu_check.MARGIN) * args.time_budget, planned
    everything = gpu_check.plan_checks(gpu_check.parse_args(["--variants", ",".join(gpu_check.GPU_RECIPES)]), False)
    seconds = {c.variant: c.seconds for c in everything}
    assert seconds["qwen3_4b_gsm8k"] > seconds["qwen2_5_3b_gsm8k"] > seconds["qwen2_5_1_5b_gsm8k_calc"]
    assert sum(seconds.values()) > args.time_budget  # all of them do not fit one call
    longer = gpu_check.plan_checks(gpu_check.parse_args(["--steps", "4"]), False)
    assert all(a.seconds > b.seconds for a, b in zip(longer, checks) if gpu_check.VARIANTS[a.variant].kind == "train")
    assert gpu_check.allotment(100, 1000) == gpu_check.ALLOTMENT * 100 and gpu_check.allotment(100, 60) == 60
    assert "planned" in gpu_check.plan_table(checks, args.time_budget).splitlines()[-1]


class Worker:
    """Stands in for gpu_check.run_variant(args, variant, recipe, seconds) -> the check's result: it takes
    `took[variant]` seconds of the fake clock (a check past its allotment returns the timeout's error row), and
    records the file as it was when each check started."""

    def __init__(self, clock, out, took):
        self.clock, self.out, self.took, self.calls, self.seen = clock, out, took, [], []

    def __call__(self, args, variant, recipe, seconds):
        import json

        self.calls.append((variant, recipe, seconds))
        self.seen.append(json.loads(self.out.read_text()) if self.out.exists() else None)
        spent = min(self.took[variant], seconds)
        self.clock.now += spent
        if spent < self.took[variant]:
            return {"variant": variant, "recipe": recipe, "error": f"stopped after {seconds:.0f} s (its allotment)"}
        return {"variant": variant, "recipe": recipe, "steps": 2, "seconds": spent}


def test_gpu_check_fakes_keep_the_contracts_they_stand_in_for():
    """Worker stands in for run_variant (its arguments, a result row naming variant and recipe) and FakeMemory for
    CudaMemory (the methods PhaseProbe calls)."""
    import inspect

    gpu_check = _gpu_check()
    assert list(inspect.signature(gpu_check.run_variant).parameters) == ["args", "variant", "recipe", "seconds"]
    assert list(inspect.signature(Worker.__call__).parameters)[1:] == ["args", "variant", "recipe", "seconds"]
    assert list(inspect.signature(gpu_check.run_checks).parameters)[3:] == ["runner", "clock"]
    public = lambda cls: {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}  # noqa: E731
    assert public(FakeMemory) == public(gpu_check.CudaMemory) == {"reset", "peak", "used"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_gpu_check_writes_one_file_after_every_check(tmp_path):
    import json

    gpu_check = _gpu_check()
    args = gpu_check.parse_args(["--variants", "qwen2_5_1_5b_gsm8k,engine-logits,gemma3_1b_gsm8k,unsloth-4bit-vllm"])
    checks = gpu_check.plan_checks(args, vllm_importable=False)
    out, clock = tmp_path / "gpu_check.json", Clock()
    worker = Worker(clock, out, {"qwen2_5_1_5b_gsm8k": 300, "engine-logits": 100, "gemma3_1b_gsm8k": 100})
    results = gpu_check.run_checks(args, checks, out, runner=worker, clock=clock)
    # the anchor ran past its allotment and was stopped there; the next fits, the third no longer does
    anchor = checks[0].seconds * gpu_check.ALLOTMENT
    assert [c[0] for c in worker.calls] == ["qwen2_5_1_5b_gsm8k", "engine-logits"]
    assert worker.calls[0][2] == pytest.approx(anchor)
    assert "its allotment" in results[0]["error"] and results[1]["steps"] == 2
    assert results[2]["skipped"].startswith("skipped: planned") and results[3]["skipped"] == gpu_check.NO_VLLM
    assert worker.seen[0] is None and [r["variant"] for r in worker.seen[1]["results"]] == ["qwen2_5_1_5b_gsm8k"]
    document = json.loads(out.read_text())  # read back: the same results, the plan, the machine, the report
    assert set(document) == {"args", "machine", "planned", "results", "report", "finished"} and document["finished"]
    assert document["results"] == results and all("planned_s" in r for r in results)
    assert [p["variant"] for p in document["planned"]] == [c.variant for c in checks]
    assert document["args"]["time_budget"] == 420 and "versions" in document["machine"]
    assert "its allotment" in document["report"] and "skipped: planned" in document["report"]
    assert not list(tmp_path.glob("*.partial"))


def test_gpu_check_answers_help_and_its_plan_on_cpu():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--card-gib" in out.stdout and "engine-logits" in out.stdout, out.stderr
    planned = subprocess.run([sys.executable, str(script), "--plan"], capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0 and "of the 420 s budget" in planned.stdout, planned.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="precondition: this machine has no usable CUDA GPU")
def test_gpu_check_refuses_to_measure_a_machine_without_a_gpu(tmp_path):
    """Run on a CPU machine, the check writes no file that could be read as a GPU measurement: exit 2, named."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(script), "--out", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nvidia-smi lists none" in done.stderr and "--plan" in done.stderr, done.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


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
        assert recipes[name].train.max_steps == (spec.steps or 2)
    anchor = recipes["qwen2_5_1_5b_gsm8k"]  # the shipped settings and completion length, a stage evaluation after
    shipped = __import__("lowmem_grpo.recipe_io", fromlist=["x"]).load_recipe("qwen2_5_1_5b_gsm8k")
    assert anchor.train.max_completion_length == shipped.train.max_completion_length == 512
    assert anchor.model.backend == "auto" and not anchor.train.preflight.enabled
    assert anchor.train.eval.stage.stages == ["trained"] and anchor.train.eval.stage.samples == 0
    assert not recipes["gemma3_1b_gsm8k"].train.eval.stage.problems  # only the anchor evaluates
    calc = recipes["unsloth-calc"]
    assert calc.data.calculator and calc.model.backend == "unsloth" and calc.train.max_completion_length == 24
    assert recipes["gemma3_1b_gsm8k"].model.name == str(tmp_path / "model")
    # on its 8 GB card the stage evaluation holds one batch as the plan sizes it
    real = gpu_check.variant_recipe(args, "qwen2_5_1_5b_gsm8k", "Qwen/Qwen2.5-1.5B-Instruct", tmp_path / "rows.jsonl",
                                    tmp_path / "run")
    p = plan(real, int(gpu_check.card_gib(args, real) * GIB))
    assert gpu_check.card_gib(args, real) == 8 and p.fits
    assert p.eval_batch == real.train.eval.stage.problems == 128
    small = gpu_check.variant_recipe(gpu_check.parse_args(["--card-gib", "5"]), "qwen2_5_1_5b_gsm8k",
                                     "Qwen/Qwen2.5-1.5B-Instruct", tmp_path / "rows.jsonl", tmp_path / "run")
    assert small.train.eval.stage.problems == plan(small, 5 * GIB).eval_batch < 128  # a smaller card, a cut batch


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
    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), gpu_check.UNSLOTH)
    recipe = apply_overrides(recipe, gpu_check.planned_eval(recipe, 5))
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


def test_gpu_check_records_the_plans_peak_with_prompt_sharing_engaged_and_not():
    """On CUDA the plan counts lowmem_grpo's shared-prompt pass as off (it runs on CPU only); the result carries the
    planner's figure with it engaged beside it."""
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    gpu_check = _gpu_check()
    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), [*gpu_check.HF, "train.gradient_checkpointing=false"])
    predicted = plan(recipe, 80 * GIB)
    both = gpu_check.predicted_sharing(predicted)
    assert both["predicted_allocated_unshared"] == predicted.allocated_bytes > both["predicted_allocated_shared"]


# --- the scripted model: the engine against a reference decoder, run here on CPU transformers --------------------


def _benchmark(name):
    return load_script(Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")


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
