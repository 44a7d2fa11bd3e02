"""Exports of a tiny trained run: lora, merged (in the precision that keeps the adapter, proven by logits), the retired
merged-4bit and gguf refusals, folder safety (GGUF files themselves: test_export_gguf.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_run import train_tiny

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A 2-step run with checkpoints at steps 1 and 2 and the final adapter."""
    run, _ = train_tiny(tiny_model_dir, tmp_path_factory.mktemp("export") / "run", "train.max_steps=2",
                        "train.save_steps=1")
    return run


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base_env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_DIR"}
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**base_env, "PYTHONPATH": str(REPO / "tests"), **(env or {})})


def proof_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok("Natalia sold clips to 48 of her friends in April.")["input_ids"],
            tok("<reasoning>\nShe sold 48 / 2 = 24 clips in May.\n</reasoning>")["input_ids"]]


def logits(model, ids_list):
    import torch

    with torch.inference_mode():
        return [model(input_ids=torch.tensor([ids])).logits[0] for ids in ids_list]


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def adapter_model(base_dir: Path, adapter_dir: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_lora_export_loads_with_peft(run_dir, tiny_model_dir, tmp_path):
    from lowmem_grpo.export.formats import export

    out = tmp_path / "lora"
    result = export(run_dir, "lora", out)
    assert result.step == 2 and result.max_abs_diff is None
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja",
                 "README.md"):
        assert (out / name).is_file(), name
    ids = proof_ids(tiny_model_dir)
    exported = logits(adapter_model(tiny_model_dir, out), ids)
    assert max_diff(exported, logits(adapter_model(tiny_model_dir, run_dir / "adapter"), ids)) == 0.0
    card = (out / "README.md").read_text()
    assert "PeftModel.from_pretrained" in card and "lowmem_test_rewards:length_reward | 1" in card
    assert "correctness | 2" in card and "training steps | 2 of 2" in card


def test_merged_fp32_reloads_in_plain_transformers_within_1e4(run_dir, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.export.formats import export

    out = tmp_path / "merged"
    result = export(run_dir, "merged", out, dtype="float32")
    assert result.dtype == "float32"
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4 <= result.tolerance
    assert result.adapter_effect > 1e-3, "the adapter changes logits, so the comparison means something"
    assert not (out / "adapter_config.json").exists()
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "chat_template.jinja", "README.md"):
        assert (out / name).is_file(), name
    # an independent check with other prompts: plain transformers vs base + adapter
    ids = proof_ids(tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not hasattr(merged, "peft_config")
    reference = logits(adapter_model(tiny_model_dir, run_dir / "adapter"), ids)
    assert max_diff(logits(merged, ids), reference) <= 1e-4
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert max_diff(logits(base, ids), reference) > 1e-3
    card = (out / "README.md").read_text()
    assert "## Export proof" in card and "max |logit difference|" in card and "float32" in card


def test_cli_exports_a_checkpoint(run_dir, tmp_path):
    out = tmp_path / "ckpt1"
    done = cli("export", str(run_dir), "--checkpoint", "1", "--format", "lora", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported lora" in done.stdout
    assert "training steps | 1 of 2" in (out / "README.md").read_text()
    missing = cli("export", str(run_dir), "--checkpoint", "99", "--format", "lora", "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and "checkpoint" in missing.stderr and "[1, 2]" in missing.stderr


def test_non_empty_out_is_refused_without_overwrite(run_dir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = cli("export", str(run_dir), "--format", "lora", "--out", str(out))
    assert refused.returncode == 2
    assert "not empty" in refused.stderr and "--overwrite" in refused.stderr
    assert (out / "keep.txt").read_text() == "mine"
    replaced = cli("export", str(run_dir), "--format", "lora", "--out", str(out), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "keep.txt").exists() and (out / "adapter_model.safetensors").exists()
    assert no_leftovers(tmp_path)


def test_out_inside_the_adapter_is_refused(run_dir):
    from lowmem_grpo.errors import BadInputError
    from lowmem_grpo.export.formats import export

    with pytest.raises(BadInputError, match="which the export reads"):
        export(run_dir, "lora", run_dir / "adapter", overwrite=True)


class Interrupt(KeyboardInterrupt):
    """What Ctrl-C in the middle of an export raises."""


@pytest.mark.parametrize("phase", ["merge", "save", "card"])
def test_interrupted_export_leaves_nothing(run_dir, tmp_path, phase):
    from lowmem_grpo.export.formats import export

    def interrupt(name: str) -> None:
        if name == phase:
            raise Interrupt(name)

    out = tmp_path / "merged"
    with pytest.raises(Interrupt):
        export(run_dir, "merged-16bit", out, on_phase=interrupt)
    assert not out.exists()
    assert no_leftovers(tmp_path)


def test_interrupted_overwrite_keeps_the_old_export(run_dir, tmp_path):
    from lowmem_grpo.export.formats import export

    out = tmp_path / "old"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def interrupt(name: str) -> None:
        if name == "card":
            raise Interrupt(name)

    with pytest.raises(Interrupt):
        export(run_dir, "lora", out, overwrite=True, on_phase=interrupt)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert no_leftovers(tmp_path)


def test_proof_above_tolerance_fails_and_writes_nothing(run_dir, tmp_path):
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export.formats import export

    out = tmp_path / "strict"
    with pytest.raises(LowmemError, match="above the tolerance"):
        export(run_dir, "merged-16bit", out, dtype="bfloat16", tolerance=1e-9)
    assert not out.exists() and no_leftovers(tmp_path)


@pytest.mark.gguf
def test_gguf_with_an_empty_llama_cpp_dir_is_a_clear_error(run_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "gguf"
    empty = tmp_path / "llama.cpp"
    empty.mkdir()
    via_env = cli("export", str(run_dir), "--format", "gguf", "--out", str(out), env={"LLAMA_CPP_DIR": str(empty)})
    assert via_env.returncode == 2 and f"no convert_hf_to_gguf.py at {empty}" in via_env.stderr
    assert "the converter of the installed llama-cpp-python" in via_env.stderr
    assert not out.exists()


@pytest.mark.gguf
def test_gguf_converter_failure_leaves_nothing(run_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export.formats import export

    llama = tmp_path / "llama.cpp"
    llama.mkdir()
    (llama / "convert_hf_to_gguf.py").write_text("import sys\nprint('unsupported architecture', file=sys.stderr)\n"
                                                 "sys.exit(1)\n")
    out = tmp_path / "gguf"
    with pytest.raises(LowmemError, match="unsupported architecture"):
        export(run_dir, "gguf", out, llama_cpp=llama)
    assert not out.exists() and no_leftovers(tmp_path)


def test_merged_4bit_is_retired_with_a_named_error(run_dir, tmp_path):
    done = cli("export", str(run_dir), "--format", "merged-4bit", "--out", str(tmp_path / "q"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "merged-4bit is retired" in done.stderr
    assert "--format merged-16bit" in done.stderr and "--format gguf --gguf-type q4_k_m" in done.stderr
    assert not (tmp_path / "q").exists()


def test_unknown_run_dir_and_format_are_bad_input(tmp_path):
    assert cli("export", str(tmp_path), "--format", "lora", "--out", str(tmp_path / "o")).returncode == 2
    assert cli("export", str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "o")).returncode == 2


EVAL_JSON = {"metrics": {"strict_accuracy": 0.25, "lenient_accuracy": 0.5, "num_problems": 4},
             "settings": {"split": "test", "num_problems": 4},
             "comparison": {"strict_accuracy": {"base": 0.0, "adapter": 0.25, "diff": 0.25, "low": 0.0, "high": 0.5}}}


def test_model_card_includes_the_latest_evaluation(run_dir, tmp_path):
    import json
    import shutil

    from lowmem_grpo.export.formats import export

    evaluated = tmp_path / "run"
    shutil.copytree(run_dir, evaluated)
    (evaluated / "eval" / "test-20260101-000000").mkdir(parents=True)
    (evaluated / "eval" / "test-20260101-000000" / "eval.json").write_text(json.dumps(EVAL_JSON))
    export(evaluated, "lora", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "From `eval/test-20260101-000000/eval.json` (split test, num_problems 4)" in card
    assert "| strict_accuracy | 0.25 |" in card and "| strict_accuracy | 0 | 0.25 | 0.25 (0 to 0.5) |" in card


def test_incomplete_checkpoint_is_refused(run_dir, tmp_path):
    import shutil

    from lowmem_grpo.errors import BadInputError
    from lowmem_grpo.export.formats import export

    partial = tmp_path / "run"
    shutil.copytree(run_dir, partial)
    (partial / "checkpoint-1" / "lowmem_complete.json").unlink()  # as if killed mid-save
    with pytest.raises(BadInputError, match="incomplete"):
        export(partial, "lora", tmp_path / "out", checkpoint=1)
    assert not (tmp_path / "out").exists()


def test_an_export_that_lost_the_adapter_fails_the_default_proof(run_dir, tmp_path):
    """PEFT's unload() drops the LoRA layers without merging them: the saved model is the base model. Asked for in a
    precision or left to choose (it tries each precision that keeps the change), the export fails, writing nothing."""
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export.formats import export

    for dtype in ("bfloat16", "float32", None):
        out = tmp_path / f"lost-{dtype}"
        with pytest.raises(LowmemError, match="lost the adapter|above the tolerance"):
            export(run_dir, "merged", out, dtype=dtype, merge=lambda model: model.unload())
        assert not out.exists() and no_leftovers(tmp_path)


def test_tolerance_publishes_a_lost_adapter_only_with_a_warning_in_the_log_and_the_card(run_dir, tmp_path, caplog):
    from lowmem_grpo.export.formats import export

    out = tmp_path / "lost"
    with caplog.at_level("WARNING", logger="lowmem_grpo"):
        result = export(run_dir, "merged", out, dtype="float32", tolerance=1e9, merge=lambda model: model.unload())
    assert result.effect["error"] == pytest.approx(1.0, abs=1e-3)  # the base model: none of the adapter's effect
    assert result.warnings and "cannot tell this export from one that lost the adapter" in result.warnings[0]
    assert any("lost the adapter" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    card = (out / "README.md").read_text()
    assert "> **Warning:** the logits of this float32 export" in card and "--tolerance" in card


def scaled_run(run_dir: Path, scale: float, target: Path) -> Path:
    """A copy of the run whose adapter's LoRA B matrices are multiplied by `scale`: the same directions, a smaller
    change (what a lower learning rate or fewer steps give)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(run_dir, target)
    path = target / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v * scale if "lora_B" in k else v for k, v in tensors.items()}, str(path))
    return target


def effect_error(out: Path, dtype: str, base_dir: Path, adapter_dir: Path, ids: list[list[int]]) -> float:
    """|export - base in its dtype - (adapter - base in float32)| / |adapter - base in float32|, on other prompts than
    the export's proof."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    exported, export_base = logits(load(out), ids), logits(load(base_dir), ids)
    reference = logits(adapter_model(base_dir, adapter_dir), ids)
    base = logits(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval(), ids)
    err = sum(float(((e.float() - b.float()) - (r - f)).pow(2).sum()) for e, b, r, f in
              zip(exported, export_base, reference, base))
    return (err / sum(float((r - f).pow(2).sum()) for r, f in zip(reference, base))) ** 0.5


@pytest.mark.parametrize("scale", [1.0, 0.02, 1e-4])
def test_the_default_export_keeps_a_small_adapter(run_dir, tiny_model_dir, tmp_path, scale):
    """The default export measures what each precision keeps of this adapter's change and writes the smallest that
    keeps it: 16 bits for the run's adapter, float32 only where neither 16-bit precision keeps a tiny one. Its logits,
    on prompts of its own, carry the adapter's float32 effect within the proof's bound."""
    from lowmem_grpo.export.formats import export
    from lowmem_grpo.export.proof import MAX_EFFECT_ERROR

    run = scaled_run(run_dir, scale, tmp_path / "run")
    out = tmp_path / "merged"
    result = export(run, "merged", out)
    measured = result.precision["measured"]
    assert result.effect["error"] <= MAX_EFFECT_ERROR
    assert effect_error(out, result.dtype, tiny_model_dir, run / "adapter", proof_ids(tiny_model_dir)) <= \
        MAX_EFFECT_ERROR
    sixteen = [d for d in ("bfloat16", "float16") if measured[d]["keeps"]]
    if scale == 1.0:
        assert result.dtype == "bfloat16"
    if scale == 1e-4:  # neither 16-bit precision keeps it: float32, said so
        assert not sixteen and result.dtype == "float32"
    if sixteen:  # no larger than float16 where a 16-bit precision keeps the change
        assert result.dtype in sixteen
    card = (out / "README.md").read_text()
    assert f"The merged weights are **{result.dtype}**" in card and "| float16 |" in card
    assert f"(merged, {result.dtype})" in card

def test_the_cli_default_is_merged_and_says_its_precision(run_dir, tmp_path):
    """`export RUN --out DIR` without --format: the merged export in the precision it measured, said on stdout, in
    the log and in the card; --help says the same default."""
    out = tmp_path / "default"
    done = cli("export", str(run_dir), "--out", str(out), "--no-score")
    assert done.returncode == 0, done.stderr[-2000:]
    card = (out / "README.md").read_text()
    dtype = card.split("The merged weights are **")[1].split("**")[0]
    assert f"exported merged to {out}" in done.stdout and f"precision {dtype}: keeps" in done.stdout
    assert f"precision of the export: {dtype}" in done.stderr
    helped = cli("export", "--help")
    assert "merged (default)" in " ".join(helped.stdout.split())



def test_merged_16bit_refuses_an_adapter_no_16_bit_precision_keeps(run_dir, tmp_path):
    run = scaled_run(run_dir, 1e-4, tmp_path / "run")
    done = cli("export", str(run), "--format", "merged-16bit", "--out", str(tmp_path / "m16"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no 16-bit precision keeps this adapter's change" in done.stderr and "--format merged" in done.stderr
    assert not (tmp_path / "m16").exists() and no_leftovers(tmp_path)
    float32 = cli("export", str(run), "--format", "merged-16bit", "--dtype", "float32", "--out", str(tmp_path / "x"))
    assert float32.returncode == 2 and "holds 16-bit weights" in float32.stderr


def test_exported_adapter_names_the_original_base_not_unsloths_4bit_repo(run_dir, tmp_path):
    """Unsloth loads unsloth/<Name>-unsloth-bnb-4bit for a 4-bit base and PEFT records it; the export names the
    recipe's model, so the adapter loads on the model that was meant."""
    import json
    import shutil

    import yaml

    from lowmem_grpo.export.formats import export

    run = tmp_path / "unsloth-run"
    shutil.copytree(run_dir, run)
    config_path = run / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "unsloth/Qwen2.5-1.5B-Instruct-unsloth-bnb-4bit"
    config_path.write_text(json.dumps(config))
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["name"] = "Qwen/Qwen2.5-1.5B-Instruct"
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "lora"
    export(run, "lora", out)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "Qwen/Qwen2.5-1.5B-Instruct"
    assert "Qwen/Qwen2.5-1.5B-Instruct" in (out / "README.md").read_text()
