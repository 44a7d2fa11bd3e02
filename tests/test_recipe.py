"""The typed recipe: shipped recipes validate, overrides are type-checked, bad values name the key."""

from __future__ import annotations

import pytest
import yaml

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe, TrainConfig, resolved_rewards
from lowmem_grpo.recipe_io import (
    apply_overrides,
    dump_yaml,
    load_recipe,
    recipe_from_dict,
    shipped_recipes,
)
from lowmem_grpo.recipe_rules import validate
from tiny_run import cpu_runtime

CPU_RECIPE = "recipes/smollm2_135m_gsm8k_cpu.py"


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(str(path))
    validate(recipe)
    assert recipe.name and recipe.description
    text = path.read_text()
    assert "lowmem-grpo train recipes/" + path.name in text, "the recipe states the command that runs it"


def test_shipped_recipes_cover_the_promised_models():
    names = {load_recipe(str(p)).model.name for p in shipped_recipes()}
    assert "embedded:smollm2-135m-instruct" in names
    assert len(shipped_recipes()) >= 1


def test_yaml_round_trip_is_identical():
    recipe = load_recipe(CPU_RECIPE, ["train.top_p=0.9", "rewards.correctness=3.0"])
    again = recipe_from_dict(yaml.safe_load(dump_yaml(recipe)))
    assert again == recipe
    assert again.train.extra == {"top_p": 0.9}


def test_overrides_are_typed():
    recipe = load_recipe(CPU_RECIPE, ["train.max_steps=7", "train.learning_rate=2e-5", "lora.target_modules=q_proj,v_proj",
                                      "data.system_prompt=0.5", "model.fast_inference=null"])
    assert recipe.train.max_steps == 7
    assert recipe.train.learning_rate == pytest.approx(2e-5)
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.data.system_prompt == "0.5"  # a string field keeps the raw text
    assert recipe.model.fast_inference is None  # an explicit null is kept (and means off)


@pytest.mark.parametrize("override, key, hint", [
    ("train.max_step=3", "train.max_step", "max_steps"),
    ("lora.alhpa=8", "lora.alhpa", "did you mean 'alpha'"),
    ("lora.rank=8", "lora.rank", "known keys: alpha"),
    ("modle.name=x", "modle", "model"),
])
def test_unknown_keys_get_did_you_mean(override, key, hint):
    with pytest.raises(RecipeError) as info:
        recipe = load_recipe(CPU_RECIPE, [override])
        from lowmem_grpo.train.grpo import check_trainer_fields

        check_trainer_fields(recipe)  # unknown train keys are checked against GRPOConfig
    assert key in str(info.value)
    assert hint in str(info.value)


@pytest.mark.parametrize("override, key", [
    ("train.max_steps=ten", "train.max_steps"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("model.load_in_4bit=maybe", "model.load_in_4bit"),
    ("model.backend=tpu", "model.backend"),
    ("rewards.correctness=high", "rewards.correctness"),
])
def test_wrong_types_name_the_key(override, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(CPU_RECIPE, [override])


def test_a_wrong_type_of_an_optional_field_gives_one_fix():
    with pytest.raises(RecipeError, match=r"data\.limit: expected int, got str 'many'") as info:
        load_recipe(CPU_RECIPE, ["data.limit=many"])
    assert str(info.value).count("fix:") == 1 and info.value.fix == "give data.limit a value of type int"


@pytest.mark.parametrize("overrides, key, fix", [
    (["train.num_generations=1"], "train.num_generations", "2 or more"),
    (["train.num_generations=3", "train.per_device_train_batch_size=8"], "train.num_generations", "multiple of 3"),
    (["data.max_prompt_length=400", "train.max_completion_length=200"], "model.max_seq_length", "raise"),
    (["lora.r=0"], "lora.r", "positive"),
    (["train.warmup_ratio=1.5"], "train.warmup_ratio", "warmup_ratio"),
    (["rewards={nope: 1.0}"], "rewards.nope", "module:function"),
    (["train.output_dir=/tmp/x"], "train.output_dir", "output.dir"),
])
def test_invalid_combinations_are_rejected_before_loading(overrides, key, fix):
    recipe = load_recipe(CPU_RECIPE, overrides)
    with pytest.raises(RecipeError) as info:
        validate(recipe)
    assert key in str(info.value)
    assert fix in str(info.value)


def test_generation_batch_counts_steps_per_generation():
    train = TrainConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=6)
    assert train.generation_batch_size() == 12
    validate(Recipe(train=train, model=Recipe().model))


def test_default_reward_set_and_weights():
    weights = resolved_rewards(Recipe())
    assert weights == {"correctness": 2.0, "integer": 0.5, "strict_format": 0.5, "soft_format": 0.5, "xml_count": 0.5}
    custom = apply_overrides(Recipe(), ["rewards={correctness: 1.0}"])
    assert resolved_rewards(custom) == {"correctness": 1.0}


def test_recipe_file_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def recipe(:\n    pass\n")
    with pytest.raises(RecipeError, match="syntax error"):
        load_recipe(str(broken))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(RecipeError, match="recipe\\(\\)"):
        load_recipe(str(empty))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(tmp_path / "missing.py"))
    bad_yaml = tmp_path / "recipe.yaml"
    bad_yaml.write_text("train: {max_steps: [\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(str(bad_yaml))


def test_grpo_config_takes_the_recipe(tmp_path):
    from lowmem_grpo.train.grpo import build_grpo_config, check_trainer_fields

    recipe = load_recipe(CPU_RECIPE, ["train.warmup_ratio=0.1", "train.top_p=0.8", "train.max_steps=20"])
    check_trainer_fields(recipe)
    config = build_grpo_config(recipe, tmp_path, cpu_runtime(recipe), reward_weights=[2.0, 0.5, 0.5, 0.5, 0.5])
    assert config.warmup_steps == pytest.approx(0.1)  # a ratio of max_steps in TRL 1.x
    assert config.top_p == pytest.approx(0.8)
    assert config.bf16 is False and config.fp16 is False  # TRL would resolve bf16=None to True on CPU
    assert config.optim == "adamw_torch"
    assert config.reward_weights == [2.0, 0.5, 0.5, 0.5, 0.5]
    assert config.max_grad_norm == pytest.approx(recipe.train.max_grad_norm)


def test_trainer_field_types_are_checked():
    from lowmem_grpo.train.grpo import check_trainer_fields

    with pytest.raises(RecipeError, match="train.top_p"):
        check_trainer_fields(load_recipe(CPU_RECIPE, ["train.top_p=high"]))


def test_small_gpu_defaults():
    t = TrainConfig()
    assert (t.learning_rate, t.adam_beta1, t.adam_beta2, t.weight_decay) == (5e-6, 0.9, 0.99, 0.1)
    assert (t.warmup_ratio, t.lr_scheduler_type, t.max_grad_norm, t.logging_steps) == (0.1, "cosine", 0.1, 1)
    assert t.gradient_checkpointing and t.optim == "auto"


def test_the_goal_reward_is_one_of_the_rewards_and_defaults_to_the_tasks():
    from lowmem_grpo.recipe import goal_reward, goal_reward_name

    assert goal_reward(Recipe()) == "correctness" and goal_reward_name(Recipe()) == "correctness"
    assert goal_reward(apply_overrides(Recipe(), ["rewards={xml_count: 1.0}"])) is None  # no goal: the total
    custom = apply_overrides(Recipe(), ["rewards={xml_count: 1.0, 'lowmem_test_rewards:length_reward': 1.0}",
                                        "goal_reward=lowmem_test_rewards:length_reward"])
    validate(custom)
    assert goal_reward(custom) == "lowmem_test_rewards:length_reward" and goal_reward_name(custom) == "length_reward"
    with pytest.raises(RecipeError, match="goal_reward") as info:
        validate(apply_overrides(Recipe(), ["rewards={xml_count: 1.0}", "goal_reward=correctness"]))
    assert "add rewards.correctness" in info.value.fix


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.stem)
def test_every_shipped_recipe_has_correctness_as_its_goal(path):
    from lowmem_grpo.recipe import goal_reward

    recipe = load_recipe(str(path))
    assert recipe.task == "gsm8k" and goal_reward(recipe) == "correctness" in resolved_rewards(recipe)
    # a recipe whose rewards leave correctness out has no goal unless it names one
    assert goal_reward(apply_overrides(recipe, ["rewards={xml_count: 1.0}"])) is None


def test_calculator_is_off_by_default_and_needs_gsm8k_data():
    assert load_recipe(CPU_RECIPE).data.calculator is False
    for source in ("generated", "embedded", "hub"):
        recipe = load_recipe(CPU_RECIPE, ["data.calculator=true", f"data.source={source}"])
        assert recipe.data.calculator is True
        validate(recipe)
    recipe = load_recipe(CPU_RECIPE, ["data.calculator=true", "task=custom", "prime.enabled=false",
                                      "rewards={xml_count: 1.0}"])
    with pytest.raises(RecipeError, match=r"data\.calculator.*'custom'") as info:
        validate(recipe)
    assert "data.calculator=false" in info.value.fix
    validate(load_recipe(CPU_RECIPE, ["task=custom", "prime.enabled=false", "rewards={xml_count: 1.0}"]))
