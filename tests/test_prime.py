"""The prime stage: rendered targets earn full rewards, priming lowers the loss, GRPO starts from the primed adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_grpo.data import load_rows
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.data.format import clean_reasoning, priming_pairs, render_target
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.rewards import correctness, integer, soft_format, strict_format, xml_count

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = "recipes/smollm2_135m_gsm8k_cpu.py"
PREFILLS = ["", "<reasoning>\n", "<reasoning>", "<reasoning>\nLet me work it out step by step.\n",
            "<reasoning>\nFirst,"]
FORMAT_REWARDS = [strict_format, soft_format, integer, xml_count]
TRAIN_ROWS = load_rows("embedded", "train")


@pytest.mark.parametrize("prefill", PREFILLS, ids=repr)
def test_every_rendered_train_target_earns_the_full_score(prefill):
    """A property over the whole embedded train split: prefill + target scores 1.0 under every GSM8K reward."""
    completions = [render_target(row["answer"], prefill) for row in TRAIN_ROWS]
    prefills = [prefill] * len(completions)
    for reward in FORMAT_REWARDS:
        scores = reward(completions, prefill=prefills)
        failing = [(i, completions[i]) for i, s in enumerate(scores) if s != 1.0]
        assert not failing, f"{reward.__name__} below 1.0 on {len(failing)} targets, e.g. {failing[0]!r}"
    scores = correctness(completions, answer=[row["answer"] for row in TRAIN_ROWS], prefill=prefills)
    assert scores == [1.0] * len(TRAIN_ROWS)


def test_targets_drop_calculator_annotations_and_keep_the_arithmetic():
    row = TRAIN_ROWS[0]
    assert "<<" in row["answer"]
    target = render_target(row["answer"], "<reasoning>\n")
    assert "<<" not in target and ">>" not in target and "####" not in target
    assert "7*7=49" in target and target.endswith("<answer>\n57\n</answer>")
    assert clean_reasoning("A is 2*3=<<2*3=6>>6.\n\n#### 6") == "A is 2*3=6."
    # a solution with no worked lines still renders a non-empty reasoning block
    assert strict_format([render_target("#### 12", "")]) == [1.0]


def _calls(text):
    """Every `<<E=` in `text`, with the index after its "="."""
    import re

    return [(m.group(1), m.end()) for m in re.finditer(r"<<([^<>=]*)=", text)]


@pytest.mark.parametrize("prefill", ["<reasoning>\n", ""], ids=repr)
def test_calculator_targets_keep_the_calls_the_engine_completes(prefill):
    """With data.calculator every `<<E=` of a rendered target is followed by exactly what the engine forces,
    and prefill + target still earns the full score (generated rows of every level and the embedded sample)."""
    from lowmem_grpo.data.generated import generate_rows
    from lowmem_grpo.rewards import expression
    from lowmem_grpo.rewards.calculator import forced_text

    rows = generate_rows("train", 60, "1-5", 0, "arithmetic") + TRAIN_ROWS[:60]
    completions = [render_target(row["answer"], prefill, calculator=True) for row in rows]
    prefills, answers = [prefill] * len(rows), [row["answer"] for row in rows]
    for reward in (strict_format, correctness, expression):
        kwargs = {"answer": answers} if reward is not strict_format else {}
        assert reward(completions, prefill=prefills, **kwargs) == [1.0] * len(rows), reward.__name__
    for row, completion in zip(rows, completions):
        calls = _calls(completion)
        assert len(calls) == row["answer"].count("<<") > 0
        for expr, end in calls:
            assert completion.startswith(forced_text(expr), end), completion
        assert "=<<" not in completion and "=$<<" not in completion  # GSM8K's duplicate expression is gone
    assert render_target(rows[0]["answer"], prefill) == render_target(rows[0]["answer"], prefill, calculator=False)


def test_calculator_rendering_of_gsm8k_lines():
    assert clean_reasoning("She now has 49-4=<<49-4=45>>45 fish.\n#### 45", calculator=True) == \
        "She now has <<49-4=45>>45 fish."
    assert clean_reasoning("He makes $4*5=$<<4*5=20>>20.\n#### 20", calculator=True) == "He makes $<<4*5=20>>20."
    assert clean_reasoning("So 49 - 4 = <<49-4=45>>45\n#### 45", calculator=True) == "So <<49-4=45>>45"
    # the value is the calculator's, and GSM8K's copy after ">>" follows it
    assert clean_reasoning("Each gets 100/3=<<100/3=33.33>>33.33.\n#### 33", calculator=True) == \
        "Each gets <<100/3=33.333333>>33.333333."
    assert clean_reasoning("Half is .5*10=<<.5*10=5.0>>5.0 kg\n#### 5", calculator=True) == "Half is <<.5*10=5>>5 kg"
    # an expression the calculator refuses is removed, as without the calculator
    assert clean_reasoning("It is 3x=<<3x=6>>6 now <<a=b=c>>\n#### 6", calculator=True) == "It is 3x=6 now"
    # more than the duplicate in front: left as written, the call still complete
    assert clean_reasoning("12+49-4=<<49-4=45>>45\n#### 57", calculator=True) == "12+49-4=<<49-4=45>>45"


# (solution line, its calculator rendering): GSM8K's copy of the result after ">>" is any number of the value of
# the annotation's result, read as the rewards read numbers, and follows the calculator's text
COPY_CLASSES = [
    ("Half is 1/2=<<1/2=.5>>.5 now", "Half is <<1/2=0.5>>0.5 now"),  # a decimal part alone
    ("It fell <<5-8=-3>>\u22123 degrees", "It fell <<5-8=-3>>-3 degrees"),  # the Unicode minus
    ("So <<3/4=3/4>>3/4 of it", "So <<3/4=0.75>>0.75 of it"),  # a fraction
    ("They made <<12*1000=12000>>12k", "They made <<12*1000=12000>>12000"),  # a magnitude
    ("It is <<1000+200=1200>>1,200 now", "It is <<1000+200=1200>>1200 now"),  # thousands commas
    ("It is <<2+3=5>>5,000 now", "It is <<2+3=5>>5,000 now"),  # another number: not the copy
    ("Then <<10*2=20>>20/2=10", "Then <<10*2=20>>20/2=10"),
    ("Either <<2*3=6>>6 or 7", "Either <<2*3=6>>6 or 7"),  # the copy, then a second number
    ("He got <<4*5=20>>$20", "He got <<4*5=20>>$20"),  # a copy with a currency sign: left as written
]


@pytest.mark.parametrize("line,rendered", COPY_CLASSES, ids=lambda v: ascii(v)[:30])
def test_the_copy_after_an_annotation_is_read_as_the_rewards_read_numbers(line, rendered):
    from lowmem_grpo.rewards.calculator import calculations

    assert clean_reasoning(f"{line}\n#### 1", calculator=True) == rendered
    assert all(calc.arithmetic_right for calc in calculations(rendered))


def test_a_gold_in_scientific_notation_is_rendered_as_correctness_reads_it():
    solution = "It is 1/100000=<<1/100000=0.00001>>0.00001 of it.\n#### 1e-05"
    completion = render_target(solution, "<reasoning>\n")
    assert completion.endswith("<answer>\n0.00001\n</answer>")
    assert correctness([completion], answer=[solution], prefill=["<reasoning>\n"]) == [1.0]
    assert correctness([completion], answer=[1e-05], prefill=["<reasoning>\n"]) == [1.0]
    assert render_target("#### 1.5E3", "").endswith("<answer>\n1500\n</answer>")


# answers as the hub's openai/gsm8k writes them: prose arithmetic, often with "x" for "*", in front of each annotation
HUB_ANSWERS = [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
     "April and May.\n#### 72",
     "Natalia sold <<48/2=24>>24 clips in May.\nNatalia sold <<48+24=72>>72 clips altogether in April and May."),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10."
     "\n#### 10",
     "Weng earns $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned $<<0.2*50=10>>10."),
    ("Maila read 12 x 2 = <<12*2=24>>24 pages today.\nShe has 5 x $3 = $<<5*3=15>>15 left.\n#### 15",
     "Maila read <<12*2=24>>24 pages today.\nShe has $<<5*3=15>>15 left."),
]


@pytest.mark.parametrize("answer,reasoning", HUB_ANSWERS, ids=["plain", "dollars", "times"])
def test_calculator_priming_renders_hub_gsm8k_answers_as_the_engine_completes_them(answer, reasoning):
    """Priming on GSM8K with data.calculator: each `<<E=R>>` stays, written as the engine completes `<<E=` (the
    calculator's R and `>>`, then GSM8K's copy of R), and the prose duplicate of E in front of it goes."""
    from lowmem_grpo.rewards import expression
    from lowmem_grpo.rewards.calculator import forced_text

    completion = render_target(answer, "<reasoning>\n", calculator=True)
    gold = answer.rpartition("#### ")[2]
    assert completion == f"{reasoning}\n</reasoning>\n<answer>\n{gold}\n</answer>"
    for expr, end in _calls(completion):
        assert completion.startswith(forced_text(expr), end)
    for reward in (strict_format, correctness, expression):
        kwargs = {"answer": [answer]} if reward is not strict_format else {}
        assert reward([completion], prefill=["<reasoning>\n"], **kwargs) == [1.0], reward.__name__


def test_the_prose_in_front_of_an_annotation_goes_only_when_it_is_the_duplicate():
    # more arithmetic runs into the duplicate: left as written, the call still the calculator's
    assert clean_reasoning("3 x 12 x 2 = <<12*2=24>>24\n#### 72", calculator=True) == "3 x 12 x 2 = <<12*2=24>>24"
    assert clean_reasoning("Total: 2 + 49-4 = <<49-4=45>>45\n#### 47", calculator=True) == \
        "Total: 2 + 49-4 = <<49-4=45>>45"
    assert clean_reasoning("In 2 days, 12 x 2 = <<12*2=24>>24\n#### 24", calculator=True) == "In 2 days, <<12*2=24>>24"
    assert clean_reasoning("It costs 3 \u00d7 4 = <<3*4=12>>12\n#### 12", calculator=True) == "It costs <<3*4=12>>12"
    # prose that is not the expression stays
    assert clean_reasoning("So 2 x 3 = <<3*2=6>>6\n#### 6", calculator=True) == "So 2 x 3 = <<3*2=6>>6"


def test_the_embedded_gsm8k_sample_keeps_every_annotation_for_the_calculator():
    for split in ("train", "test"):
        for row in load_rows("embedded", split):
            kept = _calls(clean_reasoning(row["answer"], calculator=True))
            assert len(kept) == row["answer"].count("<<") > 0, row["answer"]


def test_the_prefill_is_what_separates_the_target_from_the_full_turn():
    """Rewards score prefill + completion: without the prefill the completion alone is not in format."""
    completion = render_target(TRAIN_ROWS[1]["answer"], "<reasoning>\n")
    assert not completion.startswith("<reasoning>")
    assert strict_format([completion]) == [0.0]
    assert strict_format([completion], prefill=["<reasoning>\n"]) == [1.0]
    assert xml_count([completion]) == [0.75] and xml_count([completion], prefill=["<reasoning>\n"]) == [1.0]


def test_prompts_carry_the_prefill_and_pairs_complete_them(tiny_model_dir):
    from transformers import AutoTokenizer

    from lowmem_grpo.data import build_examples

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = build_examples(TRAIN_ROWS[:8], tokenizer, "Use the format.", "<reasoning>\n", 256)
    pairs = priming_pairs(examples, num_examples=5)
    assert len(pairs) == 5
    with_calculator = priming_pairs(examples, num_examples=5, calculator=True)
    assert [p["prompt"] for p in with_calculator] == [p["prompt"] for p in pairs]
    assert all("<<" not in p["completion"] for p in pairs) and all("<<" in p["completion"] for p in with_calculator)
    for example, pair in zip(examples, pairs):
        assert example["prompt"].endswith("<|im_start|>assistant\n<reasoning>\n")
        assert example["prefill"] == "<reasoning>\n" and pair["prompt"] == example["prompt"]
        full = pair["prompt"][-len("<reasoning>\n"):] + pair["completion"]
        assert strict_format([full]) == [1.0]
        assert correctness([pair["completion"]], answer=[example["answer"]], prefill=[example["prefill"]]) == [1.0]


@pytest.mark.parametrize("prefill", ["Answer:", "<answer>\n", "<reasoning>\n</reasoning>\n"])
def test_priming_rejects_a_prefill_its_targets_cannot_follow(prefill):
    with pytest.raises(RecipeError) as info:
        render_target(TRAIN_ROWS[0]["answer"], prefill)
    assert "data.prefill" in str(info.value) and info.value.fix
    recipe = load_recipe(CPU_RECIPE, ["prime.enabled=true", f"data.prefill={json.dumps(prefill)}"])
    with pytest.raises(RecipeError, match="data.prefill"):
        validate(recipe)
    validate(load_recipe(CPU_RECIPE, ["prime.enabled=false", f"data.prefill={json.dumps(prefill)}"]))


@pytest.mark.parametrize("override, key", [
    ("prime.max_steps=0", "prime.max_steps"),
    ("prime.learning_rate=0", "prime.learning_rate"),
    ("prime.num_examples=0", "prime.num_examples"),
    ("prime.per_device_train_batch_size=-1", "prime.per_device_train_batch_size"),
    ("prime.warmup_ratio=1.5", "prime.warmup_ratio"),
])
def test_bad_prime_values_name_the_key(override, key):
    with pytest.raises(RecipeError) as info:
        validate(load_recipe(CPU_RECIPE, [override]))
    assert key in str(info.value) and info.value.fix


def test_prime_keys_are_strict_and_typed():
    with pytest.raises(RecipeError, match="did you mean 'max_steps'"):
        load_recipe(CPU_RECIPE, ["prime.max_step=3"])
    with pytest.raises(RecipeError, match="prime.enabled"):
        load_recipe(CPU_RECIPE, ["prime.enabled=sometimes"])
    recipe = load_recipe(CPU_RECIPE, ["prime.learning_rate=5e-4", "prime.num_examples=16"])
    assert recipe.prime.learning_rate == pytest.approx(5e-4) and recipe.prime.num_examples == 16


def test_importing_prime_stays_light():
    code = ("import sys, lowmem_grpo.train.prime\n"
            "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- training on the tiny model -----------------------------------------------------------------

PRIME_STEPS = 8


def tiny_prime_overrides(model_dir: Path, run_dir: Path, backend: str) -> list[str]:
    return [f"model.name={model_dir}", f"model.backend={backend}", f"output.dir={run_dir}",
            "prime.enabled=true", f"prime.max_steps={PRIME_STEPS}", "prime.learning_rate=5e-3",
            "prime.num_examples=32", "prime.per_device_train_batch_size=4",
            "train.max_steps=2", "train.max_completion_length=16", "train.max_truncated_targets=1",
            "train.mask_truncated_completions=false", "train.save_steps=10",
            "rewards={strict_format: 0.5, 'prime_probe:prefill_seen': 1.0, 'lowmem_test_rewards:length_reward': 1.0}"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_adapter_file(adapter_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def target_loss(model, tokenizer, pairs: list[dict[str, str]]) -> float:
    """Mean per-token NLL of the completions (with EOS) given their prompts, in plain torch."""
    import torch

    losses = []
    model.eval()
    with torch.no_grad():
        for pair in pairs:
            prompt_ids = tokenizer(pair["prompt"])["input_ids"]
            ids = tokenizer(pair["prompt"] + pair["completion"] + tokenizer.eos_token)["input_ids"]
            start = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), len(prompt_ids))
            labels = [-100] * start + ids[start:]
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            losses.append(float(out.loss))
    return sum(losses) / len(losses)


def check_stages(run_dir: Path) -> None:
    records = metrics(run_dir)
    prime_steps = [r for r in records if r["stage"] == "prime" and "loss" in r]
    assert [r["step"] for r in prime_steps] == list(range(1, PRIME_STEPS + 1))
    assert all("reward" not in r for r in prime_steps)
    grpo_steps = [r for r in records if r["stage"] == "grpo" and "reward" in r]
    assert [r["step"] for r in grpo_steps] == [1, 2]
    # TRL hands the prefill column to the rewards, which score prefill + completion
    assert all(r["rewards/prefill_seen/mean"] == 1.0 for r in grpo_steps)
    stage_order = [r["stage"] for r in records]
    assert stage_order == sorted(stage_order, key=["prime", "grpo"].index), "prime lines come before GRPO's"


def check_target_loss_fell(recipe, run_dir: Path) -> None:
    """The primed adapter's loss on the rendered targets it trained on is below the base model's."""
    from lowmem_grpo.backends import load
    from lowmem_grpo.data import build_examples
    from lowmem_grpo.data import load_train_rows

    from lowmem_grpo.recipe_io import apply_overrides
    from tiny_run import cpu_runtime

    hf = cpu_runtime(apply_overrides(recipe, ["model.backend=hf"]))
    base = load(recipe, hf, with_lora=False)
    primed = load(recipe, hf, with_lora=False, adapter_path=str(run_dir / "primed_adapter"))
    d = recipe.data
    examples = build_examples(load_train_rows(recipe.data), base.tokenizer, d.system_prompt, d.prefill, d.max_prompt_length)
    pairs = priming_pairs(examples, recipe.prime.num_examples)  # the rendered targets it was primed on
    before = target_loss(base.model, base.tokenizer, pairs)
    after = target_loss(primed.model, primed.tokenizer, pairs)
    # the tiny model starts near uniform (ln 600 = 6.4); 8 LoRA steps move it down by ~0.3, far past noise
    assert after < before - 0.1, f"priming moved the target loss only from {before:.3f} to {after:.3f}"


def check_start_state(start: dict, primed: dict, final: dict) -> None:
    import torch

    assert set(start) == set(primed) and start
    for name, tensor in primed.items():
        assert torch.equal(start[name], tensor), f"GRPO did not start from the primed {name}"
    assert any(float(t.abs().max()) > 0 for n, t in primed.items() if "lora_B" in n), "priming moved LoRA B off 0"
    assert any(not torch.equal(final[n], primed[n]) for n in primed), "GRPO then trained the primed adapter"


@pytest.mark.slow
def test_priming_lowers_the_target_loss_and_grpo_starts_from_it_hf(tiny_model_dir, tmp_path):
    from prime_probe import start_state_probe

    from lowmem_grpo.train.pipeline import train

    run_dir = tmp_path / "run"
    recipe = load_recipe(CPU_RECIPE, tiny_prime_overrides(tiny_model_dir, run_dir, "hf"))
    probe = start_state_probe()
    train(recipe, callbacks=[probe])

    assert probe.trainer_args == "GRPOConfig"
    primed = load_adapter_file(run_dir / "primed_adapter")
    check_start_state(probe.state, primed, load_adapter_file(run_dir / "adapter"))
    check_stages(run_dir)

    check_target_loss_fell(recipe, run_dir)


PROBE_SCRIPT = """
import sys
from pathlib import Path
from lowmem_grpo.backends import prepare
prepare("unsloth")  # Unsloth first, as train() does, before the probe imports transformers
from prime_probe import start_state_probe
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.train.pipeline import train
run_dir = Path(sys.argv[1])
train(load_recipe(sys.argv[2], sys.argv[3:]), callbacks=[start_state_probe(run_dir.parent / "grpo_start.safetensors")])
"""


@pytest.mark.slow
def test_unsloth_backend_primes_and_grpo_starts_from_it(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(run_dir), CPU_RECIPE,
                           *tiny_prime_overrides(tiny_model_dir, run_dir, "unsloth")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "env.json").read_text())["backend"] == "unsloth"
    start = load_file(str(tmp_path / "grpo_start.safetensors"))
    check_start_state(start, load_adapter_file(run_dir / "primed_adapter"), load_adapter_file(run_dir / "adapter"))
    check_stages(run_dir)
    check_target_loss_fell(load_recipe(str(run_dir / "recipe.yaml")), run_dir)


def test_the_embedded_default_primes_with_a_compatible_prefill():
    recipe = load_recipe(CPU_RECIPE)
    assert recipe.prime.enabled and recipe.data.prefill == "<reasoning>\n"
    validate(recipe)  # includes the prefill check priming needs


def test_the_gpu_calculator_recipe_primes_on_gsm8k_solutions_for_the_calculator():
    """recipes/qwen2_5_1_5b_gsm8k_calc.py: GSM8K from the hub, backend auto, the calculator in the loop, priming on the
    worked solutions rendered as the engine completes them, and the expression reward beside the answer's."""
    from lowmem_grpo.rewards import expression

    recipe = load_recipe("recipes/qwen2_5_1_5b_gsm8k_calc.py")
    validate(recipe)
    d = recipe.data
    assert (d.source, d.calculator, recipe.prime.enabled, recipe.model.backend) == ("hub", True, True, "auto")
    assert recipe.model.fast_inference is False and recipe.rewards["expression"] > 0 and recipe.train.eval.stage.problems
    answer, reasoning = HUB_ANSWERS[0]
    completion = render_target(answer, d.prefill, d.calculator)
    assert completion.startswith(reasoning) and "48/2 =" not in completion
    assert expression([completion], prefill=[d.prefill], answer=[answer]) == [1.0]


@pytest.mark.parametrize("level", [2, 3])
def test_priming_shows_every_calculation_of_a_generated_chain_as_the_calculator_completes_it(level):
    """A worked chain is rendered one line per calculation, each `<<a op b=c>>c` (GSM8K's annotations without the
    duplicate expression in front), so priming shows the model how to call the calculator again after its result."""
    from lowmem_grpo.data.generated import generate_rows
    from lowmem_grpo.rewards.calculator import forced_text
    from lowmem_grpo.rewards.chain import gold_chain

    for row in generate_rows("train", 20, level, 3):
        completion = render_target(row["answer"], "<reasoning>\n", calculator=True)
        lines = completion.split("\n</reasoning>")[0].split("\n")
        assert len(lines) == level == len(gold_chain(row["answer"]))
        for line, step in zip(lines, row["answer"].split("\n")):
            expr, value = step.split("<<")[1].split(">>")[0].split("=")
            call = f"<<{expr}={forced_text(expr)}"
            assert call in line and line.split(call)[1].startswith(value) and f"{expr}=<<" not in line
        assert correctness(["<reasoning>\n" + completion], answer=[row["answer"]]) == [1.0]
