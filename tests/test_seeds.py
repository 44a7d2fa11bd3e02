"""benchmarks/seeds.py's pure parts: the queue it writes and the seed-spread table the run report reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_grpo.rundir.stage_tables import seed_spread_lines
from scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "seeds.py"


@pytest.fixture(scope="module")
def seeds():
    return load_script(SCRIPT)  # imports nothing heavy: training and evaluation run in subprocesses


def finished(queue: Path, name: str, seed: int, diff: float | None) -> dict:
    (queue.parent / name).mkdir(parents=True, exist_ok=True)
    (queue.parent / name / "recipe.yaml").write_text("name: smollm2-135m-arith-cpu\n", encoding="utf-8")
    gains = {"heldout1": {"primed": 0.6, "trained": 0.8, "diff": 0.2, "low": 0.1, "high": 0.3}}
    if diff is not None:
        gains["report100"] = {"primed": 0.6, "trained": 0.6 + diff, "diff": diff, "low": diff - 0.1, "high": diff + 0.1}
    return {"name": name, "config": name.split("-s")[0], "seed": seed, "recipe": "", "overrides": [],
            "gains": gains, "status": "done" if diff is not None else "pending"}


def test_add_queues_one_entry_per_seed_with_its_seed_override(seeds, tmp_path):
    queue = tmp_path / "queue.json"
    assert seeds.add(queue, "p8x4", "", "42,7", ["train.num_generations=4"], "why", False) == 0
    entries = json.loads(queue.read_text())
    assert [e["name"] for e in entries] == ["p8x4-s42", "p8x4-s7"]
    assert entries[1]["overrides"] == ["train.num_generations=4", "train.seed=7"]
    assert set(entries[0]["gains"]) == {"heldout1", "checking", "report100"}


def test_spread_writes_the_finished_seeds_report_gains_under_the_recipes_name(seeds, tmp_path):
    queue = tmp_path / "results" / "queue.json"
    queue.parent.mkdir()
    entries = [finished(queue, "default-s42", 42, 0.22), finished(queue, "default-s7", 7, 0.07),
               finished(queue, "default-s101", 101, None), finished(queue, "p8x4-s42", 42, 0.5)]
    queue.write_text(json.dumps(entries))
    out = tmp_path / "seed_spread.json"
    out.write_text(json.dumps({"other-recipe": {"num_problems": 100, "gains": {"1": 0.1, "2": 0.2}}}))
    assert seeds.spread(queue, "default", out) == 0
    table = json.loads(out.read_text())
    assert table["other-recipe"]["gains"] == {"1": 0.1, "2": 0.2}  # other recipes' spreads are kept
    spread = table["smollm2-135m-arith-cpu"]
    assert spread["num_problems"] == 100 and spread["gains"] == {"42": 0.22, "7": 0.07}
    # the report reads it: a gain of +0.10 sits within 2 sd of these two seeds' gains (sd 0.106), +0.40 does not
    run = {"num_problems": 100, "differences": {"primed->trained": {"strict_accuracy": {"diff": 0.10}}}}
    assert any("**Warning**" in line for line in seed_spread_lines(run, spread))
    run["differences"]["primed->trained"]["strict_accuracy"]["diff"] = 0.40
    assert not any("**Warning**" in line for line in seed_spread_lines(run, spread))


def test_spread_refuses_fewer_than_two_finished_seeds(seeds, tmp_path):
    queue = tmp_path / "queue.json"
    queue.write_text(json.dumps([finished(queue, "default-s42", 42, 0.2), finished(queue, "default-s7", 7, None)]))
    with pytest.raises(SystemExit, match="fewer than 2 finished seeds"):
        seeds.spread(queue, "default", tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()


def test_table_shows_finished_and_pending_seeds_with_the_spread_of_those_measured(seeds, tmp_path, capsys):
    queue = tmp_path / "queue.json"
    entries = [finished(queue, "default-s42", 42, 0.22), finished(queue, "default-s7", 7, 0.07)]
    entries.append({**finished(queue, "default-s101", 101, None), "gains": dict(seeds.GAINS)})  # as `add` queues it
    queue.write_text(json.dumps(entries))
    assert seeds.table(queue) == 0
    out = capsys.readouterr().out
    assert "| 101 | pending | - |" in out
    assert "report100: 2 seeds, mean +0.145" in out and "CI above 0 on 2 of 2" in out


def test_the_shipped_seed_spread_is_the_committed_queues_and_fits_its_recipe():
    """Each recipe in the package's seed-spread table is a shipped recipe whose stage evaluation has that many
    problems (else the report would compare gains on other problems), and its gains are the committed queue's."""
    from lowmem_grpo.recipe_io import load_recipe, shipped_recipes
    from lowmem_grpo.rundir.stage_tables import SEED_SPREAD_FILE

    table = json.loads(SEED_SPREAD_FILE.read_text(encoding="utf-8"))
    recipes = {r.name: r for r in map(lambda p: load_recipe(str(p)), shipped_recipes())}
    queue = json.loads((SCRIPT.parents[1] / "results" / "seeds-bf16" / "queue.json").read_text(encoding="utf-8"))
    assert table
    for name, spread in table.items():
        assert recipes[name].train.eval.stage.problems == spread["num_problems"]
        config = spread["measured"].split("configuration ", 1)[1].split()[0]  # as `seeds.py spread CONFIG` writes it
        measured = {str(e["seed"]): e["gains"]["report100"]["diff"] for e in queue
                    if e["config"] == config and "diff" in (e["gains"].get("report100") or {})}
        assert spread["gains"] == measured and len(measured) >= 2
