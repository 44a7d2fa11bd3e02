"""The GRPO memory planner: each term against hand arithmetic (and the libraries it models), its
monotonicity, the proposal and auto-fit against their budgets, the shipped configs, and `plan --json`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_grpo.errors import BadInputError, RecipeError
from lowmem_grpo.memory import logprob as ml
from lowmem_grpo.memory import terms as mt
from lowmem_grpo.memory.arch import CONFIGS_DIR, architecture_from_config, load_architecture, shipped_config_path
from lowmem_grpo.memory.fit import auto_fit, plan_with_proposal
from lowmem_grpo.memory.plan import GIB, MIB, parse_size, plan, settings_for
from lowmem_grpo.recipe import DEFAULT_TARGET_MODULES
from lowmem_grpo.recipe_io import apply_overrides, explicit_keys, load_recipe, shipped_recipes
from lowmem_grpo.recipe_rules import validate

REPO = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 600, "tie_word_embeddings": True}
GPU_RECIPES = [p for p in shipped_recipes() if load_recipe(str(p)).gpu_memory_gb]


def tiny_settings(**changes) -> mt.Settings:
    base = dict(backend="hf", load_in_4bit=True, compute_bytes=2, lora_r=8,
                target_modules=tuple(DEFAULT_TARGET_MODULES),
                optim="paged_adamw_8bit", gradient_checkpointing=True, per_device_batch=4, generation_batch=8,
                num_generations=4, prompt_len=32, completion_len=64, beta=0.0, fast_inference=False,
                gpu_memory_utilization=0.5, gpu_total_bytes=8 * GIB)
    return mt.Settings(**{**base, **changes})


@pytest.fixture(scope="module")
def tiny():
    return architecture_from_config(TINY, "tiny")


# --- terms against hand arithmetic --------------------------------------------------------------


def test_lora_parameter_count_is_exact_for_a_tiny_llama(tiny):
    # per layer, r x (in + out): q 8x(64+64)=1024, k and v 8x(64+32)=768 (GQA: 2 kv heads x 16),
    # o 1024, gate and up 8x(64+128)=1536, down 8x(128+64)=1536 -> 8192; two layers -> 16384
    s = tiny_settings()
    assert mt.lora_param_count(tiny, s) == 16384
    assert mt.lora_params(tiny, s) == mt.lora_grads(tiny, s) == 16384 * 4
    only_qv = dataclasses.replace(s, target_modules=("q_proj", "v_proj", "not_a_module"))
    assert mt.lora_param_count(tiny, only_qv) == 2 * (1024 + 768)


def test_lora_count_matches_peft_on_the_real_model(tiny):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(DEFAULT_TARGET_MODULES)))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert trainable == mt.lora_param_count(tiny, tiny_settings())
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == tiny.total_params()


def test_nf4_bytes_by_hand_and_against_bitsandbytes():
    # 4096 weights: 2048 packed + 64 uint8 absmax + 4 (one fp32 second-level absmax) + 4 offset + 64 code + 1024 code2
    assert mt.nf4_tensor_bytes(4096) == 2048 + 64 + 4 + 4 + 64 + 1024
    import torch
    import bitsandbytes.functional as F

    for shape in [(32, 64), (128, 64), (100, 70)]:
        packed, state = F.quantize_4bit(torch.randn(*shape, dtype=torch.bfloat16), blocksize=64, quant_type="nf4",
                                        compress_statistics=True)
        tensors = [packed, state.absmax, state.code, state.state2.absmax, state.offset, state.state2.code]
        assert mt.nf4_tensor_bytes(shape[0] * shape[1]) == sum(t.numel() * t.element_size() for t in tensors)


def test_base_weights_4bit_by_hand(tiny):
    # nf4 per tensor: 4096 -> 3208, 2048 -> 1024+32+4+4+64+1024 = 2152, 8192 -> 4096+128+4+4+64+1024 = 5320
    quantized = 2 * (2 * 3208 + 2 * 2152 + 3 * 5320)  # q,o + k,v + gate,up,down, two layers = 53360
    unquantized = 600 * 64 + 2 * 2 * 64 + 64  # tied embedding + 2 norms per layer + final norm = 38720
    assert mt.base_weights(tiny, tiny_settings(backend="unsloth")) == quantized + 2 * unquantized
    assert mt.base_weights(tiny, tiny_settings(backend="hf")) == quantized + 4 * unquantized  # peft casts to fp32
    assert mt.base_weights(tiny, tiny_settings(load_in_4bit=False)) == tiny.total_params() * 2
    assert mt.base_weights(tiny, tiny_settings(fast_inference=True)) == 0  # inside vLLM's reservation


def test_optimizer_state_matches_bitsandbytes_and_torch():
    import torch
    import bitsandbytes as bnb

    arch = architecture_from_config({**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                                     "num_key_value_heads": 2})
    s = tiny_settings(lora_r=16)
    sizes = mt.lora_tensors(arch, s)
    assert min(sizes) < mt.OPT8_MIN_SIZE <= max(sizes)  # both the 8-bit and the 32-bit fallback are exercised
    for cls, optim in [(bnb.optim.AdamW8bit, "adamw_8bit"), (torch.optim.AdamW, "adamw_torch")]:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        opt = cls(params, lr=1e-3)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        measured = sum(v.numel() * v.element_size() for p in params for k, v in opt.state[p].items()
                       if torch.is_tensor(v) and k != "step")
        assert mt.optimizer_state(arch, dataclasses.replace(s, optim=optim)) == measured
    assert mt.optimizer_state(arch, dataclasses.replace(s, optim="sgd")) == 0


def test_kv_cache_logits_activations_by_hand(tiny):
    s = tiny_settings()  # R=8, P=32, C=64, S=96, L=2, kv = 2 heads x 16 = 32, bf16
    assert mt.kv_cache(tiny, s) == 8 * 2 * 96 * 2 * 32 * 2
    unsloth = dataclasses.replace(s, backend="unsloth")  # decode buffers of P + 1 + 512, plus the prefill's P
    assert mt.kv_cache(tiny, unsloth) == 8 * 2 * (32 + 1 + 512 + 32) * 2 * 32 * 2
    assert mt.kv_cache(tiny, dataclasses.replace(s, fast_inference=True)) == 0
    # N = b x C = 256 scored tokens. hf (TRL's kernel): tile 256 x 600 x 2 + N x H x (rb + 4) + N x 32 + the bf16
    # copy of an fp32 lm_head chunk, 600 x 64 x 2 (hf with 4-bit, whose residual stream is fp32: rb = 4).
    # unsloth (its own kernel; a vocabulary of 2 x 16384 or less takes the chunked path): one fp32 chunk of
    # min(N, 4096) rows x ceil8(V) + N x H x 4 + N x 16
    assert ml.logits(tiny, unsloth) == 256 * 600 * 4 + 256 * 64 * 4 + 256 * 16
    assert ml.logits(tiny, s) == 256 * 600 * 2 + 256 * 64 * (4 + 4) + 256 * 32 + 600 * 64 * 2
    # per token per layer: rb x (2 + 2) x 64 + 2 x (3 x 64 + 2 x 32 + m x 128 + 8 x 7) + 4 x (2 + 4)
    assert mt.layer_activation_bytes_per_token(tiny, unsloth) == 2 * 256 + 2 * (192 + 64 + 2 * 128 + 56) + 24 == 1672
    assert mt.layer_activation_bytes_per_token(tiny, s) == 4 * 256 + 2 * (192 + 64 + 3 * 128 + 56) + 24 == 2440
    sixteen = dataclasses.replace(s, load_in_4bit=False)
    assert mt.layer_activation_bytes_per_token(tiny, sixteen) == 2 * 256 + 2 * (192 + 64 + 3 * 128 + 56) + 24 == 1928
    # T = b x S = 384 tokens; + 4 x T x H x rb, the 4 x 96 x 96 mask, the 64 x 128 x 2 dequantized weight
    tokens, mask, dequant = 4 * 96, 4 * 96 * 96, 64 * 128 * 2
    hidden_hf, hidden_bf16 = tokens * 64 * 4, tokens * 64 * 2
    assert mt.activations(tiny, s) == 2 * hidden_hf + tokens * 2440 + 4 * hidden_hf + mask + dequant  # L saved inputs
    assert mt.activations(tiny, unsloth) == 2 * hidden_bf16 + tokens * 1672 + 4 * hidden_bf16 + mask + dequant
    no_gc = dataclasses.replace(sixteen, gradient_checkpointing=False)
    assert mt.activations(tiny, no_gc) == 2 * tokens * 1928 + 4 * hidden_bf16 + mask  # every layer kept, no 4-bit


def test_unsloth_logits_term_follows_unsloths_kernel():
    """Qwen2.5-1.5B, 16 completions x 512 tokens (N = 8192), bf16, an 8 GB card: the tiled forward of
    unsloth_zoo's fused_linear: a 4096 x 16384 fp32 tile, its 4096 x H accumulator, N x H x 3 x 2, N x 16."""
    arch = load_architecture("Qwen/Qwen2.5-1.5B-Instruct")
    s = settings_for(apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), ["model.backend=unsloth"]), 8 * GIB)
    assert s.per_device_batch * s.completion_len == 8192
    flash = 4096 * 16384 * 4 + 4096 * 1536 * 4 + 8192 * 1536 * 6 + 16 * 8192
    assert ml.logits(arch, s) == flash and round(flash / MIB, 3) == 352.125
    # fp32 compute takes the chunked path: 512 rows (its floor for V = 151936) x V x 4 + N x H x 4 + N x 16
    fp32 = dataclasses.replace(s, compute_bytes=4)
    assert ml.logits(arch, fp32) == 512 * 151936 * 4 + 8192 * 1536 * 4 + 16 * 8192
    assert ml.unsloth_chunk_rows(8192, 1536, 262144) == 512 and ml.unsloth_chunk_rows(100, 64, 151936) == 100


def test_unsloth_kernel_constants_match_the_installed_source():
    """A drift guard: the defaults our unsloth term copies, read from unsloth_zoo's source (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("unsloth_zoo")
    if spec is None:
        pytest.skip("unsloth_zoo is not installed")
    source = (Path(spec.origin).parent / "fused_losses" / "fused_linear.py").read_text(encoding="utf-8")

    def default(env: str) -> float:
        match = re.search(rf'"{env}",\s*([0-9.]+)', source)
        assert match, env
        return float(match.group(1))

    assert default("UNSLOTH_FUSED_LINEAR_SPLIT_COLS") == ml.UNSLOTH_SPLIT_COLS
    assert default("UNSLOTH_FUSED_LINEAR_MAX_ROWS") == ml.UNSLOTH_MAX_ROWS
    assert default("UNSLOTH_LOGPROB_CHUNK_GB") * GIB == ml.UNSLOTH_CHUNK_BYTES
    assert re.search(r'"UNSLOTH_FUSED_LINEAR_BWD_TILE_MB", 8 if _HIP_TILES else (\d+)\)', source).group(1) == \
        str(ml.UNSLOTH_BWD_TILE_BYTES // MIB)
    assert "_MIN_LOGITS = 512 * 151936" in source and "_SMALL_CARD_BYTES = 24.5 * 1024**3" in source


def test_reference_vllm_and_sliding_window_terms(tiny):
    s = tiny_settings()
    assert mt.reference_model(tiny, s) == 0
    assert mt.reference_model(tiny, dataclasses.replace(s, beta=0.04)) == 8 * 64 * 4
    assert mt.vllm_reservation(tiny, s) == 0
    assert mt.vllm_reservation(tiny, dataclasses.replace(s, fast_inference=True)) == int(0.5 * 8 * GIB)
    # Unsloth takes the share of the memory free at load, not of the total
    free = dataclasses.replace(s, fast_inference=True, gpu_free_bytes=3 * GIB)
    assert mt.vllm_reservation(tiny, free) == int(0.5 * 3 * GIB)
    gemma = architecture_from_config({**TINY, "model_type": "gemma3_text", "num_hidden_layers": 6,
                                      "sliding_window": 512, "sliding_window_pattern": 6, "head_dim": 16})
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert gemma.kv_tokens(768) == 5 * 512 + 768 and gemma.kv_tokens(100) == 600
    assert gemma.norms_per_layer == 4 and gemma.qk_norm


def test_plan_is_static_plus_the_larger_phase(tiny):
    recipe = load_recipe("qwen2_5_1_5b_gsm8k")
    p = plan(recipe, 8 * GIB)
    gen, train = p.phases["generation"], p.phases["training"]
    assert p.total_bytes == p.phases["static"] + max(gen, train) + p.terms["allocator_slack"]
    assert p.peak_phase == ("generation" if gen > train else "training")
    assert p.allocated_bytes < p.reserved_bytes < p.total_bytes
    assert all(isinstance(v, int) and v >= 0 for v in p.terms.values())


# --- monotonic in each setting ------------------------------------------------------------------


@pytest.mark.parametrize("key,values", [
    ("train.max_completion_length", [64, 128, 256, 512, 1024]),
    ("train.per_device_train_batch_size", [8, 16, 32, 64]),
    ("lora.r", [4, 8, 16, 32, 64]),
])
def test_peak_grows_with_each_setting(key, values):
    base = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), ["model.max_seq_length=2048"])
    totals = [plan(apply_overrides(base, [f"{key}={v}"])).total_bytes for v in values]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_peak_grows_with_num_generations():
    base = load_recipe("llama3_2_1b_gsm8k")
    totals = [plan(apply_overrides(base, [f"train.num_generations={g}", f"train.per_device_train_batch_size={2 * g}"]),).total_bytes for g in (2, 4, 8, 16)]  # two prompts per step, G completions each
    assert totals == sorted(totals) and totals[0] < totals[-1]


# --- proposal -----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["qwen2_5_1_5b_gsm8k", "qwen3_4b_gsm8k", "gemma3_1b_gsm8k"])
@pytest.mark.parametrize("gib", [2.5, 3, 4, 6, 8, 12, 24])
def test_proposal_never_exceeds_the_budget(recipe_name, gib):
    recipe = load_recipe(recipe_name)
    budget = int(gib * GIB)
    proposal = plan_with_proposal(recipe, budget).proposal
    assert set(proposal) == {"num_generations", "per_device_train_batch_size", "generation_batch_size",
                             "max_completion_length", "gpu_memory_utilization"}
    for knob, entry in proposal.items():
        if entry is None:
            continue
        assert entry["total_bytes"] <= budget, knob
        changed = apply_overrides(recipe, [f"{k}={v}" for k, v in entry["changes"].items()])
        validate(changed)  # a proposal is a valid recipe, and its total is what the plan of that recipe says
        assert plan(changed, budget).total_bytes == entry["total_bytes"]


def test_vllm_moves_weights_and_cache_into_its_reservation():
    recipe = apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), ["model.backend=unsloth", "model.fast_inference=true",
                                                                 "model.gpu_memory_utilization=0.5"])
    p = plan_with_proposal(recipe, 8 * GIB)
    assert p.terms["vllm_reservation"] == 4 * GIB and p.terms["base_weights"] == p.terms["kv_cache"] == 0
    share = p.proposal["gpu_memory_utilization"]
    assert 0.5 <= share["value"] < 1 and share["total_bytes"] <= 8 * GIB
    assert plan(apply_overrides(recipe, ["model.gpu_memory_utilization=0.95"]), 8 * GIB).fits is False
    fitted, fit = auto_fit(apply_overrides(recipe, ["model.gpu_memory_utilization=0.95"]), 8 * GIB, set())
    assert fit.fits and fitted.model.gpu_memory_utilization < 0.95


def test_proposal_is_empty_when_nothing_fits():
    proposal = plan_with_proposal(load_recipe("qwen3_4b_gsm8k"), 1 * GIB).proposal
    assert all(entry is None for entry in proposal.values())


# --- shipped configs and recipes ----------------------------------------------------------------

FAMILY = {"Qwen/Qwen2.5": "qwen2", "Qwen/Qwen3": "qwen3", "meta-llama/Llama": "llama", "google/gemma-3": "gemma3_text",
          "HuggingFaceTB/SmolLM2": "llama"}


@pytest.mark.parametrize("path", [str(p) for p in shipped_recipes()], ids=lambda p: Path(p).stem)
def test_every_recipe_model_has_a_shipped_config_of_its_family(path):
    name = load_recipe(path).model.name
    config = shipped_config_path(name)
    assert config is not None, f"no shipped config for {name}"
    hub_id = "HuggingFaceTB/SmolLM2" if name.startswith("embedded:") else name
    expected = next(v for k, v in FAMILY.items() if hub_id.startswith(k))
    assert json.loads(config.read_text())["model_type"] == expected == load_architecture(name).model_type


def shipped_configs() -> dict[str, Path]:
    """Hub id -> shipped config path, for every config in the package."""
    return {p.stem.replace("__", "/", 1): p for p in sorted(CONFIGS_DIR.glob("*.json"))}


@pytest.mark.parametrize("hub_id", sorted(shipped_configs()))
def test_shipped_config_builds_the_model_it_describes(hub_id):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(shipped_configs()[hub_id].read_text())
    assert data.get("_source"), "every shipped config says where it came from"
    config = AutoConfig.for_model(**{k: v for k, v in data.items() if not k.startswith("_")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == load_architecture(hub_id).total_params()


@pytest.mark.parametrize("path", [str(p) for p in GPU_RECIPES], ids=lambda p: Path(p).stem)
def test_every_gpu_recipe_is_predicted_under_its_target(path):
    recipe = load_recipe(path)
    assert recipe.gpu_memory_gb in (8, 12, 16, 24) and recipe.model.load_in_4bit and recipe.data.source == "hub"
    doc = Path(path).read_text().split('"""')[1]
    stated = re.search(r"peak ([\d.]+) GiB with Unsloth.*?, ([\d.]+) GiB with (?:plain\s+)?transformers", doc, re.S)
    assert stated, "the docstring states the planner's prediction"
    for backend, text in zip(("unsloth", "hf"), stated.groups()):
        total = plan(apply_overrides(recipe, [f"model.backend={backend}"]), recipe.gpu_memory_gb * GIB,).total_bytes
        assert total < recipe.gpu_memory_gb * GIB
        assert abs(total / GIB - float(text)) <= 0.1 * float(text), \
            f"docstring says {text} GiB, planner {total / GIB:.2f}"


# --- auto-fit -----------------------------------------------------------------------------------


def test_auto_fit_keeps_a_recipe_that_fits():
    recipe = load_recipe("qwen2_5_1_5b_gsm8k")
    fitted, p = auto_fit(recipe, 8 * GIB, set())
    assert fitted == recipe and p.fits


@pytest.mark.parametrize("explicit", [set(), {"train.max_completion_length"}, {"train.per_device_train_batch_size"},
                                      {"train.num_generations", "train.max_completion_length"}])
def test_auto_fit_fits_without_touching_explicit_keys(explicit):
    recipe = apply_overrides(load_recipe("qwen3_4b_gsm8k"), ["train.max_completion_length=2048",
                                                             "model.max_seq_length=2304"])
    budget = 7 * GIB
    assert not plan(recipe, budget).fits
    fitted, p = auto_fit(recipe, budget, explicit)
    validate(fitted)
    assert p.fits and p.total_bytes <= budget
    assert plan(fitted, budget).total_bytes == p.total_bytes
    for key in explicit:
        section, name = key.split(".", 1)
        assert getattr(getattr(fitted, section), name) == getattr(getattr(recipe, section), name), key
    t = fitted.train
    assert t.generation_batch_size() % t.num_generations == 0
    assert t.generation_batch_size() % t.per_device_train_batch_size == 0


def test_auto_fit_names_the_explicit_settings_that_cannot_fit():
    recipe = apply_overrides(load_recipe("qwen3_4b_gsm8k"), ["train.max_completion_length=4096",
                                                             "model.max_seq_length=4352"])
    explicit = explicit_keys(["train.max_completion_length=4096", "train.per_device_train_batch_size=16",
                              "train.num_generations=8", "model.max_seq_length=4352"])
    with pytest.raises(RecipeError) as info:
        auto_fit(recipe, 6 * GIB, explicit)
    message = str(info.value)
    assert "train.max_completion_length=4096" in message and "train.per_device_train_batch_size=16" in message
    with pytest.raises(RecipeError, match="smaller model"):
        auto_fit(load_recipe("qwen3_4b_gsm8k"), 2 * GIB, set())  # the 4-bit weights alone do not fit


def test_explicit_keys_and_sizes():
    assert explicit_keys(["train.max_steps=5", " lora.r = 8", "junk", "=3"]) == {"train.max_steps", "lora.r"}
    assert parse_size("8GiB") == 8 * GIB == parse_size("8") == parse_size("8 G")
    assert parse_size("12GB") == 12 * 10**9 and parse_size("512MiB") == 512 * MIB and parse_size("7.5GiB") == 7.5 * GIB
    for bad in ("lots", "8 parsecs", "0GiB", "-3G"):
        with pytest.raises(BadInputError):
            parse_size(bad)


def test_fit_to_device_without_cuda_and_the_saved_plan(tmp_path):
    from lowmem_grpo.memory.fit import fit_to_device
    from lowmem_grpo.rundir.layout import PLAN_FILE, write_json

    from lowmem_grpo.device import CudaFacts

    recipe = load_recipe("qwen2_5_1_5b_gsm8k")
    no_gpu = CudaFacts(torch_cuda="13.0", available=False)
    assert fit_to_device(recipe, set(), facts=no_gpu) == (recipe, None)  # no CUDA GPU: nothing changes
    result = plan(recipe, 8 * GIB)
    write_json(tmp_path / PLAN_FILE, result.to_dict())  # as train() saves it
    saved = json.loads((tmp_path / PLAN_FILE).read_text())
    assert saved["total_bytes"] == result.total_bytes and saved["terms"] == result.terms


def test_gpu_benchmark_tokenizer_and_prompts_have_the_real_sizes(tmp_path):
    import scripted_model

    tokenizer = scripted_model.build_tokenizer(tmp_path, 1000)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id < 1000
    scripted_model.write_rows(tmp_path / "rows.jsonl", count=3, length=40 - scripted_model.PROMPT_OVERHEAD)
    for line in (tmp_path / "rows.jsonl").read_text().splitlines():
        text = tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["question"]}],
                                             tokenize=False, add_generation_prompt=True)
        assert len(tokenizer(text)["input_ids"]) == 40  # the planner's prompt length, exactly


def test_architecture_sources(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert load_architecture(str(tmp_path)).hidden_size == 64
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="no config.json"):
        load_architecture(str(tmp_path / "empty"))
    with pytest.raises(BadInputError, match="no shipped config"):
        load_architecture("Someone/Unknown-Model", allow_hub=False)
    assert load_architecture("embedded:smollm2-135m-instruct").hidden_size == 576
    s = settings_for(load_recipe("smollm2_135m_gsm8k_cpu"))
    # the planner sizes a GPU run: model.dtype=auto counts 16-bit weights whatever this CPU would resolve it to
    assert (s.backend, s.load_in_4bit, s.compute_bytes) == ("hf", False, 2)


# --- the CLI ------------------------------------------------------------------------------------


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **env}, timeout=120)


def test_plan_json_schema():
    out = _cli("plan", "recipes/qwen2_5_1_5b_gsm8k.py", "train.max_completion_length=256", "--gpu-memory", "6GiB",
               "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"total_bytes", "fits", "terms", "proposal"} <= set(data)
    assert data["fits"] is True and data["budget_bytes"] == 6 * GIB and data["settings"]["completion_len"] == 256
    assert {"base_weights", "lora_params", "lora_grads", "optimizer_state", "activations", "kv_cache", "logits",
            "reference_model", "vllm_reservation", "cuda_context", "allocator_slack"} <= set(data["terms"])
    assert all(isinstance(v, int) for v in data["terms"].values())
    assert all(e is None or e["total_bytes"] <= 6 * GIB for e in data["proposal"].values())
    text = _cli("plan", "qwen2_5_1_5b_gsm8k")  # the recipe's own 8 GB
    assert text.returncode == 0 and "fits" in text.stdout and "kv_cache" in text.stdout


def test_plan_bad_input_exits_2():
    no_gpu = _cli("plan", "smollm2_135m_gsm8k_cpu", CUDA_VISIBLE_DEVICES="")
    assert no_gpu.returncode == 2 and "--gpu-memory" in no_gpu.stderr
    assert _cli("plan", "qwen2_5_1_5b_gsm8k", "--gpu-memory", "lots").returncode == 2
    offline = _cli("plan", "qwen2_5_1_5b_gsm8k", "model.name=Someone/Unknown-Model", HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "fix:" in offline.stderr


def test_planner_imports_nothing_heavy():
    code = ("import sys, lowmem_grpo.memory.plan, lowmem_grpo.memory.fit\n"
            "from lowmem_grpo.memory.plan import plan\nfrom lowmem_grpo.recipe_io import load_recipe\n"
            "plan(load_recipe('qwen3_4b_gsm8k'), 8 * 2**30)\n"
            "heavy = ('torch', 'transformers', 'trl', 'unsloth', 'huggingface_hub')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- prompt sharing: our shared-prompt pass -------------------------------------------------------------------

def _sharing(recipe_name: str, overrides: list[str]):
    from lowmem_grpo.memory.sharing import sharing_for
    from lowmem_grpo.runtime import planned

    recipe = apply_overrides(load_recipe(recipe_name), overrides)
    return sharing_for(load_architecture(recipe.model.name), planned(recipe), recipe)


def test_unsloths_prefix_grouping_is_not_modelled():
    from lowmem_grpo.memory import sharing as ms

    one_group = ["model.backend=unsloth", "train.per_device_train_batch_size=8", "train.num_generations=8",
                 "train.steps_per_generation=1"]
    for overrides in (one_group, ["model.backend=unsloth"]):
        result = _sharing("qwen2_5_1_5b_gsm8k", overrides)
        assert (result.applies, result.available) == (ms.NONE, ms.NONE)
        assert "not modelled: the plan counts full rows" in result.reason


def test_shared_prompt_rules_on_the_hf_path():
    """Ours runs the loss pass in the CPU trainer, without gradient checkpointing, on full-attention models."""
    from lowmem_grpo.memory import sharing as ms

    qwen, gemma = load_architecture("Qwen/Qwen2.5-1.5B-Instruct"), load_architecture("google/gemma-3-1b-it")
    runs = dict(shared_prompt=True, num_generations=8, gradient_checkpointing=False, device="cpu")
    assert ms.hf_shared_prompt(qwen, **runs).applies == ms.HF
    for change, words in [({"shared_prompt": False}, "train.cpu.fast=false"),
                          ({"num_generations": 1}, "nothing to share"),
                          ({"gradient_checkpointing": True}, "gradient checkpointing drops the KV cache"),
                          ({"device": "cuda"}, "on cuda TRL's own log-prob pass runs")]:
        result = ms.hf_shared_prompt(qwen, **{**runs, **change})
        assert result.applies == ms.NONE and result.available == ms.HF and words in result.reason, change
    assert "sliding-window layers" in ms.hf_shared_prompt(gemma, **runs).reason
    # a plan is for CUDA: the shipped recipe names both of its reasons
    assert load_recipe("qwen2_5_1_5b_gsm8k").train.cpu.fast is True
    shipped = _sharing("qwen2_5_1_5b_gsm8k", ["model.backend=hf"])
    assert shipped.applies == ms.NONE and "gradient checkpointing" in shipped.reason and "on cuda" in shipped.reason


def test_shared_prompt_runs_in_the_cpu_trainer_only():
    """The planner's device rule, against the trainer each device gets."""
    from lowmem_grpo.memory import sharing as ms
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer, grpo_trainer_class
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.runtime import resolve

    recipe = load_recipe("smollm2_135m_gsm8k_cpu", ["model.backend=hf"])
    for device in ("cpu", "cuda"):
        facts = CudaFacts(torch_cuda="12.6", available=device == "cuda", capability=(8, 6))
        runs_ours = issubclass(grpo_trainer_class(resolve(recipe, Launch(), facts)), CpuSafeGRPOTrainer)
        assert runs_ours == (device in ms.HF_SHARED_DEVICES), device


def test_shared_prompt_arithmetic(tiny):
    """Tiny llama, P 32, C 64, b 4, G 4, R 8: k = min(4, 8 / 4) = 2 prompts per micro-batch."""
    s = tiny_settings(load_in_4bit=False)
    shared = dataclasses.replace(s, prompt_sharing="shared_prompt")
    assert mt.prompts_in_micro_batch(s) == 2
    assert mt.forward_tokens(tiny, s) == 4 * 96 and mt.forward_tokens(tiny, shared) == 2 * 32 + 4 * 64 == 320
    # hf, bf16, checkpointing: L x T x H x 2 + T x per_token + 4 x T x H x 2 + mask b x C x S + k x P x P
    per_token = mt.layer_activation_bytes_per_token(tiny, s)
    assert mt.activations(tiny, shared) == 2 * 320 * 64 * 2 + 320 * per_token + 4 * 320 * 64 * 2 \
        + 4 * 64 * 96 + 2 * 32 * 32
    # the prompt's keys/values: L x k x P x 2 x kv x 2 bytes (each layer's cache) + b x P x 2 x kv x 2 (one expanded)
    assert mt.prompt_kv(tiny, shared) == 2 * 2 * 32 * 2 * 32 * 2 + 4 * 32 * 2 * 32 * 2
    no_gc = dataclasses.replace(shared, gradient_checkpointing=False)
    assert mt.prompt_kv(tiny, no_gc) == 2 * 4 * 32 * 2 * 32 * 2 and mt.prompt_kv(tiny, s) == 0
    # the log-prob pass scores the same N = b x C tokens either way
    assert ml.logits(tiny, shared) == ml.logits(tiny, s)
    assert mt.activations(tiny, shared) < mt.activations(tiny, s)


def test_plan_counts_the_sharing_that_applies_and_both_figures():
    no_gc = ["model.backend=hf", "train.gradient_checkpointing=false"]
    hf = plan(apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), no_gc), 80 * GIB)
    f = hf.sharing_figures
    assert hf.sharing.applies == "none" and hf.total_bytes == f["peak_without_bytes"]  # a CUDA run: TRL's pass
    assert f["saving_bytes"] == f["peak_without_bytes"] - f["peak_with_bytes"] > 0
    assert hf.terms["prompt_kv"] == 0 and "peak_with_unverified_bytes" not in f
    # counted where it applies: the same settings with the pass on
    engaged = dataclasses.replace(hf.settings, prompt_sharing="shared_prompt")
    from lowmem_grpo.memory.plan import evaluate

    assert evaluate(hf.architecture, engaged).total_bytes == f["peak_with_bytes"]
    assert mt.prompt_kv(hf.architecture, engaged) > 0
    unsloth = plan(apply_overrides(load_recipe("qwen2_5_1_5b_gsm8k"), ["model.backend=unsloth"]), 8 * GIB)
    f = unsloth.sharing_figures  # not modelled: both figures are the full-row one
    assert unsloth.total_bytes == f["peak_without_bytes"] == f["peak_with_bytes"] and f["saving_bytes"] == 0


def test_plan_output_names_the_sharing_and_prints_both_figures():
    text = _cli("plan", "qwen2_5_1_5b_gsm8k", "model.backend=hf", "train.gradient_checkpointing=false",
                "--gpu-memory", "80GiB")
    assert text.returncode == 0, text.stderr
    assert "prompt sharing: our shared-prompt pass does not run the loss pass: on cuda" in text.stdout
    assert "16 x 768 = 12288 tokens per micro-batch without it, 2 x 256 + 16 x 512 = 8704 with it" in text.stdout
    figures = re.search(r"peak without prompt sharing ([\d.]+) GiB, with our shared-prompt pass \(if it engaged\) "
                        r"([\d.]+) GiB \(saves ([\d.]+) (GiB|MiB)\)", text.stdout)
    assert figures and float(figures.group(1)) > float(figures.group(2))
    out = _cli("plan", "qwen2_5_1_5b_gsm8k", "model.backend=hf", "train.gradient_checkpointing=false", "--json")
    data = json.loads(out.stdout)["prompt_sharing"]
    assert data["applies"] == "none" and data["available"] == "shared_prompt"
    assert data["peak_with_bytes"] + data["saving_bytes"] == data["peak_without_bytes"]
    unsloth = json.loads(_cli("plan", "qwen2_5_1_5b_gsm8k", "model.backend=unsloth", "--json").stdout)
    assert unsloth["prompt_sharing"]["applies"] == "none" and "not modelled" in unsloth["prompt_sharing"]["reason"]
    assert unsloth["total_bytes"] == unsloth["prompt_sharing"]["peak_without_bytes"]


# --- the evaluation batch: its KV cache, the plan's choice, auto-fit --------------------------------------

WITH_STAGE_EVAL = ["train.eval.stage.problems=100"]  # the stage evaluation on (greedy + 4 samples a problem)


def test_eval_kv_cache_is_layers_kv_heads_head_dim_two_bytes_rows_tokens(tiny):
    """Tiny llama: L 2, 2 kv heads x head dim 16, bf16; E = 16 rows of S = 32 + 64 tokens."""
    s = tiny_settings(eval_batch=16)
    assert mt.eval_kv_cache(tiny, s) == 2 * 2 * 16 * 2 * 2 * 16 * 96  # DynamicCache: every position of every layer
    # Unsloth's decode buffers: P + 1 + 512 x ceil(C / 512) positions per layer, plus the prefill's P copied into them
    unsloth = dataclasses.replace(s, backend="unsloth")
    assert mt.eval_kv_cache(tiny, unsloth) == 2 * 2 * 16 * 2 * 2 * 16 * (32 + 1 + 512 + 32)
    assert mt.eval_kv_cache(tiny, dataclasses.replace(unsloth, completion_len=600)) == \
        2 * 2 * 16 * 2 * 2 * 16 * (32 + 1 + 1024 + 32)
    gemma2 = architecture_from_config({**TINY, "model_type": "gemma2", "head_dim": 16})  # its own increment: 256
    assert mt.eval_kv_cache(gemma2, unsloth) == 2 * 2 * 16 * 2 * 2 * 16 * (32 + 1 + 256 + 32)
    # Gemma 3 loads through Unsloth's FastModel: transformers' cache, sliding layers kept to their window
    gemma3 = architecture_from_config({**TINY, "model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16,
                                       "sliding_window": 64, "sliding_window_pattern": 6})
    assert mt.eval_kv_cache(gemma3, unsloth) == (5 * 64 + 96) * 2 * 2 * 16 * 2 * 16
    # the engine decodes it outside vLLM's pool, which holds the rollouts' cache; no evaluation, no term
    vllm = dataclasses.replace(unsloth, fast_inference=True)
    assert mt.eval_kv_cache(tiny, vllm) == mt.eval_kv_cache(tiny, unsloth) and mt.kv_cache(tiny, vllm) == 0
    assert mt.eval_kv_cache(tiny, tiny_settings()) == mt.eval_workspace(tiny, tiny_settings()) == 0
    # the generation cache is the same formula for the generation batch
    assert mt.kv_cache(tiny, dataclasses.replace(unsloth, eval_batch=0)) == mt.decode_kv_bytes(tiny, unsloth, 8)
    assert mt.eval_workspace(tiny, s) == 16 * 32 * (64 * 4 + 2 * 128 * 2) + 64 * 128 * 2 + 16 * 600 * 8


def test_unsloth_decode_buffers_match_the_installed_source():
    """A drift guard, read from the installed Unsloth (not imported): the increments our term copies, the model types
    that decode through the fast path, and the buffers it allocates and grows (their source pinned by hash)."""
    import ast
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("unsloth")
    if spec is None:
        pytest.skip("unsloth is not installed")
    models = Path(spec.origin).parent / "models"
    text = {name: (models / f"{name}.py").read_text(encoding="utf-8") for name in mt.UNSLOTH_DECODE_INCREMENTS}
    for name, increment in mt.UNSLOTH_DECODE_INCREMENTS.items():
        own = re.findall(r"^KV_CACHE_INCREMENT = (\d+)$", text[name], re.M)
        assert own == [str(increment)] or (not own and "from .llama import *" in text[name]
                                           and increment == mt.UNSLOTH_DECODE_INCREMENTS["llama"]), name
    loader = (models / "loader.py").read_text(encoding="utf-8")
    assert set(re.findall(r'(?:el)?if model_type == "(\w+)":', loader)) == set(mt.UNSLOTH_DECODE_INCREMENTS)
    graphs = (models / "_decode_graphs.py").read_text(encoding="utf-8")
    assert "(increment + seq_len + 1, 2, bsz, n_kv_heads, head_dim)" in graphs  # the eager buffer: P + 1 + inc
    assert "attn.paged_attention.resize_((rows + increment, 2, bsz, n_kv_heads, head_dim))" in graphs
    pinned = {"alloc_decode_buffers": "1ef491e03f8cde20", "resize_decode_buffers": "f46f72badc3bf25f"}
    for node in ast.parse(graphs).body:
        if isinstance(node, ast.FunctionDef) and node.name in pinned:
            digest = hashlib.sha256(ast.get_source_segment(graphs, node).encode()).hexdigest()[:16]
            assert digest == pinned.pop(node.name), f"{node.name} changed: re-read it against terms.decode_kv_bytes"
    assert not pinned
    # the prefill-shaped forward frees the buffers a decode left (they do not outlive the next phase)
    assert "if hasattr(self, \"paged_attention\"):\n        del self.paged_attention_K" in text["llama"]


def test_the_rows_an_evaluation_decodes_at_once_follow_generate():
    from lowmem_grpo.memory.plan import eval_batch_candidates, eval_rows

    source = (REPO / "lowmem_grpo" / "sampling" / "generate.py").read_text(encoding="utf-8")
    assert "per_batch = max(1, batch_size // num_samples)" in source  # batch // k problems' k samples
    for batch, k in [(16, 4), (16, 3), (2, 4), (1, 1), (128, 4)]:
        assert eval_rows(batch, k) == max(max(1, batch // k) * k, batch)
    assert eval_rows(0, 4) == 0
    assert eval_batch_candidates(128) == [128, 64, 32, 16, 8, 4, 2, 1]
    assert eval_batch_candidates(100) == [100, 64, 32, 16, 8, 4, 2, 1] and eval_batch_candidates(1) == [1]


@pytest.mark.parametrize("name,gib", [("llama3_2_3b_gsm8k", 16), ("qwen3_4b_gsm8k", 24)])
@pytest.mark.parametrize("backend", ["unsloth", "hf"])
def test_the_plan_cuts_the_evaluation_batch_to_fit(name, gib, backend):
    """At 128 rows their bf16 KV cache alone is ~14 GiB (Llama-3.2-3B, 1024 tokens) and ~22.5 GiB (Qwen3-4B, 1280
    tokens): the plan takes the largest power of two whose evaluation fits, and counts it in the peak."""
    from lowmem_grpo.memory.plan import evaluation_peak

    recipe = apply_overrides(load_recipe(name), [*WITH_STAGE_EVAL, f"model.backend={backend}"])
    arch = load_architecture(recipe.model.name)
    full = 128 * arch.num_layers * (recipe.data.max_prompt_length + recipe.train.max_completion_length) * 2 \
        * arch.kv_dim * 2
    assert full / GIB == pytest.approx({16: 14.0, 24: 22.5}[gib])
    p = plan(recipe, gib * GIB)
    e = p.evaluation
    assert e["counted"] and e["planned"] and p.eval_batch == e["batch"] < 128 and p.fits
    assert e["peak_bytes"] <= gib * GIB < evaluation_peak(arch, p.settings, 2 * e["batch"])  # the largest that fits
    assert p.terms["eval_kv_cache"] == e["kv_bytes"] and p.settings.eval_batch == e["rows"] == e["batch"]
    phases = p.phases
    assert p.total_bytes == phases["static"] + max(phases["generation"], phases["training"], phases["evaluation"]) \
        + p.terms["allocator_slack"]
    # a batch the recipe sets is taken as it is, and a plan that cannot hold it says so
    as_set = plan(apply_overrides(recipe, ["train.eval.batch_size=128"]), gib * GIB)
    assert as_set.eval_batch == 128 and not as_set.evaluation["planned"] and as_set.fits is False
    assert as_set.peak_phase == "evaluation"


def test_a_recipe_without_an_engine_evaluation_keeps_its_peak_and_shows_the_batch():
    recipe = load_recipe("qwen3_4b_gsm8k")  # no train.eval.stage.problems, no train.eval.every
    p = plan(recipe, 24 * GIB)
    assert p.eval_batch is None and p.terms["eval_kv_cache"] == p.phases["evaluation"] == 0
    assert p.evaluation["batch"] < 128 and p.evaluation["kv_bytes"] > 0  # what turning it on would take
    assert p.total_bytes == plan(apply_overrides(recipe, ["train.eval.batch_size=128"]), 24 * GIB).total_bytes
    # vLLM samples the periodic evaluation inside its own pool; the stage evaluation always runs on the engine
    vllm = ["model.backend=unsloth", "model.fast_inference=true"]
    assert plan(apply_overrides(recipe, [*vllm, "train.eval.every=10"]), 24 * GIB).eval_batch is None
    staged = plan(apply_overrides(recipe, [*vllm, *WITH_STAGE_EVAL]), 24 * GIB)
    assert staged.eval_batch and staged.terms["eval_kv_cache"] > 0 and staged.terms["vllm_reservation"] > 0
    # without a budget the evaluation stays within the GRPO step's own peak
    unbudgeted = plan(apply_overrides(recipe, WITH_STAGE_EVAL))
    assert unbudgeted.peak_phase != "evaluation" and unbudgeted.evaluation["peak_bytes"] <= unbudgeted.total_bytes


def test_auto_fit_writes_the_evaluation_batch_and_the_evaluations_read_it():
    from lowmem_grpo.evaluation.stages import periodic_settings

    recipe = apply_overrides(load_recipe("llama3_2_3b_gsm8k"), [*WITH_STAGE_EVAL, "train.eval.every=10",
                                                                "train.eval.samples=4"])
    fitted, p = auto_fit(recipe, 16 * GIB, set())
    assert p.fits and fitted.train.eval.batch_size == p.eval_batch < 128
    assert recipe.train.eval.batch_size is None  # the caller's recipe is left as it was
    greedy, sampled = periodic_settings(fitted.train)
    assert greedy["batch_size"] == sampled["batch_size"] == p.eval_batch  # the k samples of batch / k problems
    # a value the recipe sets is cut unless the user gave it; given explicitly, too large a batch is named
    too_large = apply_overrides(recipe, ["train.eval.batch_size=128"])
    assert auto_fit(too_large, 16 * GIB, set())[0].train.eval.batch_size == p.eval_batch
    with pytest.raises(RecipeError, match="train.eval.batch_size=128"):
        auto_fit(too_large, 16 * GIB, {"train.eval.batch_size"})
    small = apply_overrides(recipe, ["train.eval.batch_size=8"])
    assert auto_fit(small, 16 * GIB, set())[0].train.eval.batch_size == 8  # never raised above the recipe's


def test_plan_shows_the_evaluation_batch_and_its_memory():
    text = _cli("plan", "llama3_2_3b_gsm8k", *WITH_STAGE_EVAL)
    assert text.returncode == 0, text.stderr
    line = next(ln for ln in text.stdout.splitlines() if ln.strip().startswith("evaluation:"))
    assert re.search(r"evaluation: (\d+) sequences at once \(train.eval.batch_size, planned: the largest power of "
                     r"two up to 128 that fits\) x 1024 tokens: KV cache [\d.]+ GiB", line), line
    data = json.loads(_cli("plan", "llama3_2_3b_gsm8k", *WITH_STAGE_EVAL, "--json").stdout)
    assert data["evaluation"]["counted"] and data["evaluation"]["batch"] < 128
    assert data["terms"]["eval_kv_cache"] == data["evaluation"]["kv_bytes"]
    off = _cli("plan", "qwen3_4b_gsm8k")
    assert "evaluation: off in this recipe" in off.stdout
    from lowmem_grpo.memory.plan import format_plan

    for path in GPU_RECIPES:  # every GPU recipe's plan says what its evaluation batch is and takes
        recipe = load_recipe(str(path))
        text = format_plan(plan(recipe, recipe.gpu_memory_gb * GIB))
        assert re.search(r"  evaluation: .*\d+ sequences at once .* KV cache [\d.]+ (GiB|MiB)", text), path.name


def test_without_auto_fit_the_evaluation_batch_is_still_fitted_to_the_gpu():
    """train.memory.auto_fit=false, or several processes: the training settings stay the recipe's, and the evaluation batch
    alone is cut to what the GPU holds (a 16 GB card for Llama-3.2-3B's 128 x 1024-token evaluation KV cache)."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.memory.fit import eval_batch_to_device

    recipe = load_recipe("llama3_2_3b_gsm8k", ["train.eval.stage.problems=50", "train.memory.auto_fit=false"])
    card = CudaFacts(torch_cuda="13.0", available=True, capability=(8, 9), free_bytes=15 * GIB, total_bytes=16 * GIB)
    fitted = eval_batch_to_device(recipe, set(), facts=card)
    assert fitted.train.eval.batch_size is not None and fitted.train.eval.batch_size < 128
    assert (fitted.train.per_device_train_batch_size, fitted.train.max_completion_length) == (
        recipe.train.per_device_train_batch_size, recipe.train.max_completion_length)
    assert recipe.train.eval.batch_size is None  # the caller's recipe is not changed
    assert eval_batch_to_device(recipe, {"train.eval.batch_size"}, facts=card) is recipe  # explicit: kept
    assert eval_batch_to_device(recipe, set(), facts=CudaFacts(torch_cuda=None, available=False)) is recipe
