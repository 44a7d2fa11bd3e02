"""Exports of a tiny model that tokenizes like the embedded SmolLM2 (its tokenizer as transformers builds it from the
GGUF file): the tokenizer files llama.cpp's converter reads, GGUF files made, run and proven in llama.cpp, every
export scored on the run's held-out problems. Tests marked gguf need the extra (`make install-gguf`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_run import train_tiny

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
HAS_RUNTIME = importlib.util.find_spec("llama_cpp") is not None


def build_smol_tiny(target: Path) -> Path:
    """A 2-layer, 64-wide llama with the embedded SmolLM2 tokenizer as transformers builds and saves it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lowmem_grpo.backends.embedded import gguf_location

    folder, name = gguf_location("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    tokenizer.save_pretrained(str(target))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(target))
    return target


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory) -> Path:
    """One GRPO step on the tiny model, with the stage evaluation of base and trained on 6 held-out problems."""
    root = tmp_path_factory.mktemp("smol")
    model = build_smol_tiny(root / "model")
    run, _ = train_tiny(model, root / "run", "train.max_steps=1", "train.eval.stage.problems=6", "train.eval.stage.samples=0",
                        "train.eval.stage.stages=[base, trained]")
    return run


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_DIR"}
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHONPATH": str(REPO / "tests")})


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_merged_export_writes_a_byte_level_tokenizer_and_is_scored(smol_run, tmp_path):
    from lowmem_grpo.export.formats import export
    from lowmem_grpo.export.tokenizer_files import needs_repair
    from lowmem_grpo.rundir import export_scores, layout

    out = tmp_path / "merged"
    result = export(smol_run, "merged", out, dtype="float32")
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["byte_fallback"] is False and not needs_repair(data)
    assert result.score is not None and result.score["problems"] == 6 and "minus_adapter" in result.score
    assert "minus_base" in result.score
    entries = export_scores.read(smol_run)
    assert [e["format"] for e in entries if e["out"] == str(out.resolve())] == ["merged"]
    assert "## The gain survives export" in (smol_run / layout.REPORT_FILE).read_text(encoding="utf-8")
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "## Accuracy on the task" in card and "export - adapter" in card


@pytest.mark.skipif(HAS_RUNTIME, reason="the gguf extra is installed here")
def test_gguf_without_the_extra_exits_2_naming_the_install(smol_run, tmp_path):
    out = tmp_path / "gguf"
    done = cli("export", str(smol_run), "--format", "gguf", "--out", str(out))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "make install-gguf" in done.stderr and "llama-cpp-python" in done.stderr
    assert not out.exists() and no_leftovers(tmp_path)


def test_an_unknown_gguf_type_exits_2(smol_run, tmp_path):
    done = cli("export", str(smol_run), "--format", "gguf", "--gguf-type", "q3_k", "--out", str(tmp_path / "g"))
    assert done.returncode == 2 and "--gguf-type" in done.stderr


def llama_cpp_has_amx_kernels() -> bool:
    import llama_cpp

    from lowmem_grpo.export.llama_runner import amx_kernels

    return amx_kernels(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))


@pytest.mark.gguf
@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0", "q4_k_m"])
def test_gguf_export_runs_and_is_proven_in_llama_cpp(smol_run, tmp_path, gguf_type):
    """Every --gguf-type the docs name, at the export's default precision as the README runs them (a quantized file
    is made from the exact file of the precision that keeps the adapter)."""
    pytest.importorskip("llama_cpp")
    from lowmem_grpo.export.formats import export
    from lowmem_grpo.export.gguf_proof import GGUF_FILE_TYPES, QUANTIZED

    out = tmp_path / gguf_type
    result = export(smol_run, "gguf", out, gguf_type=gguf_type, tolerance=1.0)
    assert result.file.endswith(f"-{GGUF_FILE_TYPES[gguf_type]}.gguf")
    files = [p.name for p in out.iterdir()]
    assert result.file in files and [f for f in files if f.endswith(".gguf")] == [result.file]
    proof = result.gguf_proof
    assert (proof["tokenizer_model"], proof["tokenizer_pre"]) == ("gpt2", "smollm")
    assert proof["same_prompt_tokens"] == proof["problems"] == 6
    assert proof["chat_template_same"] is True
    if gguf_type == "f16":
        assert proof["logits"]["max_abs_diff"] < 1.0 and proof["logits"]["argmax_agreement"] > 0.9
    assert result.score is not None and result.score["problems"] == 6
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "## Proof in llama.cpp" in card and f"the proof's rule for {gguf_type}: the file " in card
    assert ("accuracy_difference" in proof) == (gguf_type in QUANTIZED)
    # a llama.cpp built with AMX kernels proves the file with repacking off and the card says how to run it
    assert proof["llama_cpp_repack"] is not llama_cpp_has_amx_kernels()
    assert ("--no-repack" in card) is not proof["llama_cpp_repack"]


@pytest.mark.gguf
def test_the_proof_runs_a_quantized_file_the_same_without_llama_cpps_repacked_kernels(smol_run, tmp_path):
    """Repacking off (what the proof does on a llama.cpp built with AMX kernels, which crash on K-quant files) loads
    the file with no extra buffer types and gives the same greedy tokens from the same weights."""
    pytest.importorskip("llama_cpp")
    from lowmem_grpo.export import gguf_proof
    from lowmem_grpo.export.formats import export

    merged = tmp_path / "merged"
    export(smol_run, "merged-16bit", merged, dtype="bfloat16", score=False)
    sixteen, quantized = tmp_path / "m-BF16.gguf", tmp_path / "m-Q4_K_M.gguf"
    gguf_proof.convert(gguf_proof.find_converter(), merged, sixteen, "bf16")
    gguf_proof.run_child({"job": "quantize", "src": str(sixteen), "dst": str(quantized), "type": "q4_k_m"}, "quantize")
    job = {"job": "generate", "model": str(quantized), "prompts": ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                                                                   "<|im_start|>assistant\n", "Hello"],
           "max_new_tokens": 12, "eos_ids": [2], "calculator": False, "n_ctx": 128}
    on, off = (gguf_proof.run_child({**job, "repack": repack}, "the proof") for repack in (True, False))
    assert on["extra_buffers"] and not off["extra_buffers"] and not off["repack"]
    assert [g["ids"] for g in on["generations"]] == [g["ids"] for g in off["generations"]]
    assert all(g["ids"] for g in off["generations"])
    assert gguf_proof.run_child(job, "the proof")["repack"] is not llama_cpp_has_amx_kernels()


@pytest.mark.gguf
def test_llama_takes_its_model_parameters_from_the_function_the_runner_sets():
    """llama_runner._load turns repacking off through llama_model_default_params, read once by Llama.__init__ before
    the model loads (Llama has no argument for use_extra_bufts)."""
    pytest.importorskip("llama_cpp")
    import inspect

    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    source = inspect.getsource(Llama.__init__)
    read = source.index("self.model_params = llama_cpp.llama_model_default_params()")
    assert read < source.index("internals.LlamaModel(") and "params=self.model_params" in source
    assert "use_extra_bufts" in dict(bindings.llama_model_params._fields_)
    assert "use_extra_bufts" not in inspect.signature(Llama.__init__).parameters


@pytest.mark.gguf
def test_the_old_tokenizer_crashes_llama_cpp_and_that_is_a_failed_proof(smol_run, tmp_path):
    """A GGUF converted from the tokenizer as transformers saves it reads as a SentencePiece vocabulary; llama.cpp
    aborts on its first tokenization. The child process turns that into an error with its stderr tail."""
    pytest.importorskip("llama_cpp")
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export import gguf_proof
    from lowmem_grpo.export.formats import export

    merged = tmp_path / "merged"
    export(smol_run, "merged", merged, dtype="float32", score=False)
    shutil.copy2(smol_run.parent / "model" / "tokenizer.json", merged / "tokenizer.json")  # as transformers saved it
    target = tmp_path / "old.gguf"
    gguf_proof.convert(gguf_proof.find_converter(), merged, target, "f16")
    assert gguf_proof.tokenizer_kind(target) == ("llama", "default")
    with pytest.raises(LowmemError, match="llama.cpp failed") as failed:
        gguf_proof.run_child({"job": "generate", "model": str(target), "prompts": ["<|im_start|>user\nHi"],
                               "max_new_tokens": 4, "eos_ids": [2], "calculator": False, "n_ctx": 64}, "the proof")
    assert "out_of_range" in str(failed.value) or "signal" in str(failed.value)


@pytest.mark.gguf
def test_a_gguf_that_fails_in_llama_cpp_leaves_nothing(smol_run, tmp_path):
    pytest.importorskip("llama_cpp")
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.export.formats import export

    llama = tmp_path / "llama.cpp"
    llama.mkdir()
    (llama / "convert_hf_to_gguf.py").write_text(
        "import sys\nout = sys.argv[sys.argv.index('--outfile') + 1]\nopen(out, 'wb').write(b'not a gguf file')\n")
    out = tmp_path / "gguf"
    with pytest.raises(LowmemError):
        export(smol_run, "gguf", out, llama_cpp=llama)
    assert not out.exists() and no_leftovers(tmp_path)
