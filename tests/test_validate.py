"""`lowmem-grpo validate` asks only for what it checks: the hub once (not through the hub libraries' retries), and
TRL only when the recipe has extra train keys to check against GRPOConfig."""

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
