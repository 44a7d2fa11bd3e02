"""`lowmem-grpo validate` asks only for what it checks: the hub once (not through the hub libraries' retries), and
TRL only when the recipe has extra train keys to check against GRPOConfig; it refuses, as `train` does before any
model loads, every combination a run could not honour (lowmem_grpo.combinations, tests/test_combinations.py)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

from lowmem_grpo.data.budget import check_recipe_budget
from lowmem_grpo.device import hub_unreachable
from lowmem_grpo.recipe_io import load_recipe

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPE = str(REPO / "recipes" / "qwen2_5_1_5b_gsm8k.py")
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there on a test machine


def test_hub_unreachable_names_the_host_at_once():
    start = time.monotonic()
    reason = hub_unreachable(environ={"HF_ENDPOINT": CLOSED})
    assert reason is not None and "127.0.0.1:9" in reason
    assert time.monotonic() - start < 3


def test_hub_reachable_offline_mode_or_a_proxy_is_not_judged_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert hub_unreachable(environ={"HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}"}) is None
    # offline mode: the libraries read their local cache without asking; a proxy: a direct connection proves nothing
    assert hub_unreachable(environ={"HF_ENDPOINT": CLOSED, "HF_HUB_OFFLINE": "1"}) is None
    assert hub_unreachable(environ={"HF_ENDPOINT": CLOSED, "HTTPS_PROXY": "http://proxy:3128"}) is None


def test_an_unreachable_hub_skips_the_budget_check_without_asking_the_hub_libraries(monkeypatch, caplog):
    import lowmem_grpo.data.sources as sources

    def never(*args, **kwargs):
        raise AssertionError("the hub data was asked for although the hub cannot be reached")

    monkeypatch.setattr(sources, "load_train_rows", never)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    recipe = load_recipe(GPU_RECIPE)  # hub data, hub model
    assert recipe.data.source == "hub"
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):
        assert check_recipe_budget(recipe, lambda: never(), hub_model=True) is None
    assert "completion budget: not checked" in caplog.text and "cannot be reached" in caplog.text
    assert "HF_HUB_OFFLINE=1" in caplog.text  # how to check against the local cache instead


def test_on_hub_tells_hub_ids_from_local_and_embedded_models(tmp_path):
    from lowmem_grpo.backends import on_hub

    assert on_hub("Qwen/Qwen2.5-1.5B-Instruct")
    assert not on_hub("embedded:smollm2-135m-instruct")
    assert not on_hub(str(tmp_path)) and not on_hub("./no-such-folder") and not on_hub("a/b/c")


def _validate_in_subprocess(*args: str) -> tuple[int, list[str], str]:
    code = ("import sys\n"
            "from lowmem_grpo.cli import main\n"
            f"code = main(['validate', *{list(args)!r}])\n"
            "print(code, sorted(m for m in ('trl', 'unsloth', 'peft') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    exit_code, modules = done.stdout.strip().splitlines()[-1].split(" ", 1)
    return int(exit_code), eval(modules), done.stderr  # noqa: S307 - our own printed list


def test_validate_imports_trl_only_for_extra_train_keys(tiny_model_dir):
    code, modules, log = _validate_in_subprocess(CPU_RECIPE, f"model.name={tiny_model_dir}")
    assert code == 0, log[-2000:]
    assert modules == [], "validate imported TRL/PEFT/Unsloth for a recipe with no extra train keys"
    code, modules, log = _validate_in_subprocess(CPU_RECIPE, f"model.name={tiny_model_dir}", "train.top_pp=0.95")
    assert code == 2 and "unknown key 'train.top_pp'" in log and "did you mean train.top_p" in log, log[-2000:]
    assert "trl" in modules  # the extra key was checked against TRL's GRPOConfig


def test_no_trainer_fields_skips_the_check_even_with_extra_keys(tiny_model_dir):
    code, modules, log = _validate_in_subprocess(CPU_RECIPE, f"model.name={tiny_model_dir}", "train.top_pp=0.95",
                                                 "--no-trainer-fields")
    assert code == 0 and "trl" not in modules, log[-2000:]


ZERO2 = ("--accelerate-config", str(REPO / "recipes" / "accelerate" / "zero2.yaml"))
ZERO3_HF = ("model.backend=hf", "model.load_in_4bit=false")
REFUSED = [  # (arguments after `validate`, words the refusal names)
    ((GPU_RECIPE, "data.calculator=true", "train.top_p=0.9"), ("data.calculator", "train.top_p", "temperature only")),
    ((GPU_RECIPE, "data.calculator=true", "model.backend=unsloth", "train.top_k=20"), ("data.calculator", "train.top_k")),
    ((GPU_RECIPE, "data.calculator=true", "train.use_vllm=true", "train.vllm_structured_outputs_regex=a+"),
     ("train.vllm_structured_outputs_regex",)),
    ((GPU_RECIPE, "data.calculator=true", "train.repetition_penalty=1.2"), ("train.repetition_penalty",)),
    ((GPU_RECIPE, *ZERO3_HF, "train.deepspeed={zero_optimization: {stage: 3}}"),
     ("DeepSpeed ZeRO-3", "was retired", "zero2.yaml")),  # TrainingArguments' own DeepSpeed config
    ((GPU_RECIPE, "model.backend=unsloth", "train.precision=fp32"), ("train.precision=fp32", "autocast")),
    ((GPU_RECIPE, "model.fast_inference=true", "--accelerate-config", str(REPO / "recipes" / "accelerate" / "ddp.yaml")),
     ("model.fast_inference=true with the hf backend",)),  # auto under 2 processes is hf: no vLLM
]
ALLOWED = [  # (arguments, words the ok line names)
    ((GPU_RECIPE, "data.calculator=true", "model.backend=unsloth"), "backend unsloth on cuda, 1 process"),
    ((GPU_RECIPE, "data.calculator=true", "model.backend=unsloth", "model.fast_inference=true"), "backend unsloth"),
    ((GPU_RECIPE, "data.calculator=true", "model.backend=hf"), "backend hf on cuda"),
    ((GPU_RECIPE, "data.calculator=true", "train.use_vllm=true", "--no-trainer-fields"), "ok"),
    ((GPU_RECIPE, "data.calculator=true", "model.backend=unsloth", "model.fast_inference=true", "train.top_k=20",
      "--no-trainer-fields"), "backend unsloth"),  # the calculator's vLLM rounds take TRL's sampling settings
    ((GPU_RECIPE, *ZERO3_HF, *ZERO2), "backend hf on cuda, 2 processes, DeepSpeed ZeRO-2"),
    ((GPU_RECIPE, "model.backend=unsloth", "--accelerate-config", str(REPO / "recipes" / "accelerate" / "ddp.yaml")),
     "backend unsloth on cuda, 2 processes"),  # Unsloth runs DDP itself (lowmem_grpo.runtime.backend_for)
    ((GPU_RECIPE, *ZERO3_HF, "train.eval.stage.problems=10", "data.calculator=true", "--accelerate-config",
      str(REPO / "recipes" / "accelerate" / "zero2.yaml")), "DeepSpeed ZeRO-2"),
]
CASES_IN_A_CHILD = """
import io, json, logging, sys, time
from contextlib import redirect_stdout
from lowmem_grpo.cli import main
results = []
for args in json.loads(sys.argv[1]):
    log, out = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("lowmem_grpo").addHandler(handler)
    start = time.monotonic()
    with redirect_stdout(out):
        code = main([sys.argv[2], *args])
    results.append({"code": code, "log": log.getvalue(), "out": out.getvalue(), "s": time.monotonic() - start})
    logging.getLogger("lowmem_grpo").removeHandler(handler)
heavy = sorted(m for m in ("torch", "transformers", "trl", "unsloth", "peft", "vllm") if m in sys.modules)
print(json.dumps({"results": results, "heavy": heavy}))
"""


def _launch_free_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables, the hub closed (the budget check says so at once)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")
           and not k.startswith("ACCELERATE_")}
    env.update(HF_ENDPOINT=CLOSED, **extra)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    return env


def _run_cases(command: str, cases: list, **env: str) -> tuple[list[dict], list[str]]:
    import json

    done = subprocess.run([sys.executable, "-c", CASES_IN_A_CHILD, json.dumps(cases), command], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=_launch_free_env(**env))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["results"], report["heavy"]


def test_validate_refuses_each_combination_a_run_could_not_honour_loading_nothing():
    """Each refusal exits 2 naming the combination and its fix, in well under a second, with no model library
    imported (so no weights could have loaded): the GPU recipe is judged on the CUDA run it is tuned for."""
    results, heavy = _run_cases("validate", [list(args) for args, _ in REFUSED])
    for (args, named), result in zip(REFUSED, results):
        assert result["code"] == 2, (args, result)
        assert all(word in result["log"] for word in named), (named, result["log"])
        assert "fix: " in result["log"] and not result["out"], result
        assert result["s"] < 5, (args, result["s"])
    assert heavy == [], f"validate imported {heavy} on its way to a refusal"


def test_validate_passes_the_calculator_on_either_backend_and_zero2():
    results, heavy = _run_cases("validate", [list(args) for args, _ in ALLOWED])
    for (args, named), result in zip(ALLOWED, results):
        assert result["code"] == 0, (args, result["log"][-2000:])
        assert result["out"].startswith("ok: ") and named in result["out"], result["out"]
        assert "\nruntime:\n  backend " in result["out"]  # the Runtime `train` would resolve, one setting a line
    assert heavy == []


def test_train_refuses_the_same_combinations_before_any_model_loads(tmp_path):
    """`train` under a ZeRO-3 launcher's environment refuses in seconds, before the process group, the run
    directory or any model library: the check validate makes, on the target train would run on."""
    ds_zero3 = tmp_path / "ds_zero3.json"
    ds_zero3.write_text('{"zero_optimization": {"stage": 3}}')
    zero3 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true",
             "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_zero3), "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "run"
    cases = [[GPU_RECIPE, *ZERO3_HF, f"output.dir={out}"], [GPU_RECIPE, "model.backend=unsloth", f"output.dir={out}"],
             [CPU_RECIPE, f"output.dir={out}"]]
    results, heavy = _run_cases("train", cases, **zero3)
    for args, result in zip(cases, results):
        assert result["code"] == 2 and "DeepSpeed ZeRO-3" in result["log"] and "was retired" in result["log"], \
            (args, result["log"])
        assert result["s"] < 60, result["s"]
    assert not out.exists()
    assert not {"transformers", "trl", "unsloth", "peft"} & set(heavy), heavy  # torch only: train asks it for CUDA
