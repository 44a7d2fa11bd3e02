"""The train section's groups: recipe files and overrides written with flat train keys (`train.stage_eval=200`) read
as the keys of its sections, every committed results/**/recipe.yaml to the settings it was run with; unknown keys
keep their errors; the one CPU switch and the paths the Runtime resolves from it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from lowmem_grpo.errors import RecipeError, RetiredSettingError
from lowmem_grpo.recipe import CpuConfig, TrainConfig
from lowmem_grpo.recipe_io import (FLAT_TRAIN_KEYS, RETIRED_KEYS, apply_overrides, dump_yaml, explicit_keys, load_recipe,
                                   recipe_from_dict, recipe_to_dict)

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")
RESULTS = sorted(REPO.glob("results/**/recipe.yaml"))
CPU_SWITCHES = ("shared_prompt", "merged_sampling", "cpu_attention", "sampling_engine")

FLAT = {
    "eval_every": lambda t: t.eval.every,
    "eval_limit": lambda t: t.eval.problems,
    "eval_samples": lambda t: t.eval.samples,
    "eval_batch_size": lambda t: t.eval.batch_size,
    "stage_eval": lambda t: t.eval.stage.problems,
    "stage_eval_stages": lambda t: t.eval.stage.stages,
    "stage_eval_samples": lambda t: t.eval.stage.samples,
    "preflight": lambda t: t.preflight.enabled,
    "preflight_prompts": lambda t: t.preflight.prompts,
    "allow_no_signal": lambda t: t.preflight.allow_no_signal,
    "auto_fit": lambda t: t.memory.auto_fit,
    "oom_retries": lambda t: t.memory.oom_retries,
    **{key: (lambda t: t.cpu.fast) for key in CPU_SWITCHES},
}
"""Each flat train key and where its setting lives: the specification FLAT_TRAIN_KEYS implements."""


def test_the_table_covers_every_flat_key_and_names_real_keys():
    assert set(FLAT_TRAIN_KEYS) == set(FLAT)
    defaults = TrainConfig()
    for flat, new in FLAT_TRAIN_KEYS.items():
        node = defaults
        for part in new.split("."):
            node = getattr(node, part)  # an AttributeError names a table entry that points nowhere
        assert node == FLAT[flat](defaults), flat


def test_the_committed_results_are_all_found():
    assert len(RESULTS) >= 10 and all(p.parent.name for p in RESULTS)


def _assert_holds(loaded, written, where: str) -> None:
    """Every value the file writes is the loaded one (keys the file predates keep their defaults)."""
    if isinstance(written, dict) and where.count(".") < 2 and where != "rewards":
        for key, value in written.items():
            _assert_holds(loaded[key], value, f"{where}.{key}")
    else:
        assert loaded == written, where


@pytest.mark.parametrize("path", RESULTS, ids=[str(p.relative_to(REPO / "results")) for p in RESULTS])
def test_every_committed_results_recipe_loads_to_the_settings_it_was_run_with(path):
    written = yaml.safe_load(path.read_text(encoding="utf-8"))
    retired = {k: v for k, v in written["train"].items() if f"train.{k}" in RETIRED_KEYS}
    retired.update({f"selection.{k}": v for k, v in (written["train"].pop("selection", None) or {}).items()})
    if any(v != RETIRED_KEYS[f"train.{k}"][0] for k, v in retired.items()):  # a run of a retired feature
        with pytest.raises(RetiredSettingError):
            load_recipe(str(path))
        return
    for key in retired:
        written["train"].pop(key, None)  # at its old default: read as absent
    recipe = load_recipe(str(path))
    loaded = recipe_to_dict(recipe)
    for section, values in written.items():
        if section != "train":
            _assert_holds(loaded[section], values, section)
    fast = all(written["train"].get(k, True) for k in CPU_SWITCHES)
    for key, value in written["train"].items():
        if key in FLAT and not isinstance(value, dict):  # `preflight`: a flat key of old files, a section of new
            assert FLAT[key](recipe.train) == (fast if key in CPU_SWITCHES else value), key
        else:
            assert loaded["train"][key] == value, key
    assert recipe_from_dict(yaml.safe_load(dump_yaml(recipe))) == recipe  # written back in sections, read the same


def test_a_curriculum_run_of_the_chains_is_refused_naming_the_retired_key_and_what_to_use():
    with pytest.raises(RetiredSettingError, match=r"train.curriculum=True: the curriculum was retired") as info:
        load_recipe(str(REPO / "results/chains-bf16/L12-p160x20-c80-curriculum/recipe.yaml"))
    assert "data.generated.grpo_levels" in info.value.fix and info.value.exit_code == 2


@pytest.mark.parametrize("override", ["train.selection.dynamic_sampling=true", "train.dynamic_sampling=true",
                                      "train.selection.curriculum=true", "train.selection.promote_at=0.7"])
def test_a_retired_setting_is_refused_and_its_old_default_is_read_as_absent(override):
    with pytest.raises(RetiredSettingError, match="was retired") as info:
        load_recipe(CPU_RECIPE, [override])
    assert info.value.fix.startswith("remove the key")
    key = override.partition("=")[0]
    assert load_recipe(CPU_RECIPE, [f"{key}={RETIRED_KEYS[key][0]}"]) == load_recipe(CPU_RECIPE)
    data = recipe_to_dict(load_recipe(CPU_RECIPE))
    data["train"]["selection"] = {"dynamic_sampling": False, "curriculum": False, "promote_at": 0.6}
    assert recipe_from_dict(data) == load_recipe(CPU_RECIPE)  # a recipe.yaml written before the retirement


def test_a_run_directory_written_with_flat_keys_loads(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text((REPO / "results/cpu-default-bf16/recipe.yaml").read_text(encoding="utf-8"))
    assert load_recipe(str(run)) == load_recipe(str(REPO / "results/cpu-default-bf16/recipe.yaml"))
    assert load_recipe(str(run)).train.eval.stage.problems == 100


@pytest.mark.parametrize("flat, sectioned", [
    ("train.stage_eval=200", "train.eval.stage.problems=200"),
    ("train.stage_eval_samples=0", "train.eval.stage.samples=0"),
    ("train.stage_eval_stages=[primed,trained]", "train.eval.stage.stages=[primed,trained]"),
    ("train.preflight=false", "train.preflight.enabled=false"),
    ("train.eval_every=5", "train.eval.every=5"),
    ("train.eval_batch_size=16", "train.eval.batch_size=16"),
    ("train.auto_fit=false", "train.memory.auto_fit=false"),
    ("train.cpu_attention=false", "train.cpu.fast=false"),
    ("train.sampling_engine=false", "train.cpu.fast=false"),
])
def test_flat_overrides_set_their_sections_key(flat, sectioned):
    assert load_recipe(CPU_RECIPE, [flat]) == load_recipe(CPU_RECIPE, [sectioned]) != load_recipe(CPU_RECIPE)
    assert explicit_keys([flat]) == explicit_keys([sectioned]) == {sectioned.partition("=")[0]}


def test_flat_overrides_are_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="lowmem_grpo.recipe_io"):
        load_recipe(CPU_RECIPE, ["train.stage_eval=7"])
    assert "recipe key train.stage_eval is read as train.eval.stage.problems" in caplog.text
    assert all(r.levelno == logging.DEBUG for r in caplog.records if "is read as" in r.getMessage())


def test_the_preflight_section_and_the_flat_switch_share_a_name():
    on = load_recipe(CPU_RECIPE, ["train.preflight={enabled: false, prompts: 4}"]).train.preflight
    assert (on.enabled, on.prompts) == (False, 4)
    data = recipe_to_dict(load_recipe(CPU_RECIPE))
    data["train"].pop("preflight")
    data["train"].update(preflight=False, preflight_prompts=3)  # the flat switch, then its section's key
    assert recipe_from_dict(data).train.preflight.enabled is False
    assert recipe_from_dict(data).train.preflight.prompts == 3


@pytest.mark.parametrize("values, fast", [
    ({k: True for k in CPU_SWITCHES}, True),
    ({"shared_prompt": True, "merged_sampling": True, "sampling_engine": True}, True),  # before cpu_attention existed
    ({**{k: True for k in CPU_SWITCHES}, "merged_sampling": False}, False),
    ({"sampling_engine": False}, False),
])
def test_the_four_cpu_switches_of_a_file_read_as_one(values, fast):
    data = recipe_to_dict(load_recipe(CPU_RECIPE))
    data["train"].pop("cpu")
    data["train"].update(values)
    assert recipe_from_dict(data).train.cpu == CpuConfig(fast=fast)


def test_a_flat_key_beside_its_sections_key_is_refused():
    data = recipe_to_dict(load_recipe(CPU_RECIPE))
    data["train"]["stage_eval"] = 5
    with pytest.raises(RecipeError, match=r"train.stage_eval and train.eval.stage.problems are both set") as info:
        recipe_from_dict(data)
    assert "keep train.eval.stage.problems only" in info.value.fix


@pytest.mark.parametrize("override, named, hint", [
    ("train.eval.evry=3", "unknown key 'train.eval.evry'", "did you mean 'every'"),
    ("train.eval.stage.problem=3", "unknown key 'train.eval.stage.problem'", "did you mean 'problems'"),
    ("train.evl.every=3", "unknown section 'train.evl'", "did you mean 'eval'"),
    ("train.memory.oom_retrys=1", "unknown key 'train.memory.oom_retrys'", "did you mean 'oom_retries'"),
])
def test_unknown_keys_in_a_section_are_named_with_a_did_you_mean(override, named, hint):
    with pytest.raises(RecipeError) as info:
        load_recipe(CPU_RECIPE, [override])
    assert named in str(info.value) and hint in str(info.value)


@pytest.mark.parametrize("override, hint", [
    ("train.stage_evl=3", "did you mean train.eval.stage.problems?"),  # a flat key's typo: its section's key
    ("train.max_stepz=3", "did you mean train.max_steps?"),
])
def test_an_unknown_train_key_is_still_checked_against_grpo_config(override, hint):
    from lowmem_grpo.train.grpo import check_trainer_fields

    recipe = load_recipe(CPU_RECIPE, [override])
    with pytest.raises(RecipeError, match="not a lowmem_grpo train setting nor a GRPOConfig field") as info:
        check_trainer_fields(recipe)
    assert hint in info.value.fix


def test_a_recipe_module_with_a_flat_train_argument_names_its_section(tmp_path):
    module = tmp_path / "flat.py"
    module.write_text("from lowmem_grpo.recipe import Recipe, TrainConfig\n\n"
                      "def recipe():\n    return Recipe(train=TrainConfig(stage_eval=100))\n")
    with pytest.raises(RecipeError, match="TrainConfig has no argument 'stage_eval': its setting is "
                                          "train.eval.stage.problems") as info:
        load_recipe(str(module))
    assert "TrainConfig(eval=EvalConfig(stage=StageEvalConfig(problems=...)))" in info.value.fix
    other = tmp_path / "other.py"
    other.write_text("from lowmem_grpo.recipe import Recipe, TrainConfig\n\n"
                     "def recipe():\n    return Recipe(train=TrainConfig(max_stepz=1))\n")
    with pytest.raises(TypeError, match="max_stepz"):  # any other TypeError is the module's own
        load_recipe(str(other))


def test_the_runtime_turns_the_cpu_paths_on_only_on_a_cpu():
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.runtime import CpuPaths, cpu_paths, resolve, rollout_plan

    on, off = CpuPaths(True, True, True), CpuPaths(False, False, False)
    assert cpu_paths(TrainConfig(), "cpu") == on
    assert cpu_paths(TrainConfig(), "cuda") == off
    assert cpu_paths(TrainConfig(cpu=CpuConfig(fast=False)), "cpu") == off
    recipe = load_recipe(CPU_RECIPE, ["data.calculator=false"])
    cpu = resolve(recipe, Launch(), CudaFacts(torch_cuda=None, available=False))
    assert cpu.cpu == on and cpu.sampler.engine
    gpu = resolve(recipe, Launch(), CudaFacts(torch_cuda="planned", available=True))
    assert gpu.cpu == off and not gpu.sampler.engine
    plain = apply_overrides(recipe, ["train.cpu.fast=false"])
    assert resolve(plain, Launch(), CudaFacts(torch_cuda=None, available=False)).cpu == off
    plan = rollout_plan(plain, "hf", "cpu")
    assert not plan.engine and plan.reason == "train.cpu.fast is false"


QUEUES = sorted(REPO.glob("results/**/queue.json"))


@pytest.mark.parametrize("path", QUEUES, ids=[str(p.relative_to(REPO / "results")) for p in QUEUES])
def test_every_committed_queue_runs_its_overrides_on_the_cpu_default(path):
    import json

    from lowmem_grpo.recipe_rules import validate

    entries = json.loads(path.read_text(encoding="utf-8"))
    assert entries
    for entry in entries:
        keys = {text.partition("=")[0]: yaml.safe_load(text.partition("=")[2]) for text in entry["overrides"]}
        if any(k in RETIRED_KEYS and v != RETIRED_KEYS[k][0] for k, v in keys.items()):  # a run of a retired feature
            with pytest.raises(RetiredSettingError):
                load_recipe(CPU_RECIPE, entry["overrides"])
            continue
        recipe = load_recipe(CPU_RECIPE, entry["overrides"])
        validate(recipe)
        for text in entry["overrides"]:
            key, _, value = text.partition("=")
            if key.startswith("train.") and key[len("train."):] in FLAT:
                assert FLAT[key[len("train."):]](recipe.train) == yaml.safe_load(value), (entry["name"], text)


def test_the_docs_write_the_sections_keys():
    """Flat train keys appear only where the docs give their sections' keys (docs/recipes.md, docs/performance.md)."""
    import re

    flat = re.compile(r"\btrain\.(" + "|".join(sorted(FLAT, key=len, reverse=True)) + r")(?![\w.])")
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {p.name: flat.findall(p.read_text(encoding="utf-8")) for p in pages}
    assert {name for name, keys in found.items() if keys} == {"recipes.md", "performance.md"}, found
