"""The rules that reject a bad recipe before any model loads, naming the key and the fix (RecipeError, exit 2)."""

from __future__ import annotations

import math

from lowmem_grpo.data.format import check_prefill
from lowmem_grpo.errors import DataError, RecipeError
from lowmem_grpo.recipe import MANAGED_TRAINER_FIELDS, GeneratedDataConfig, Recipe


def _require(condition: bool, key: str, problem: str, fix: str) -> None:
    if not condition:
        raise RecipeError(f"{key}: {problem}", fix=fix)


def validate(recipe: Recipe, num_processes: int = 1) -> None:
    """Reject invalid values and combinations, naming the key and the fix. Loads no model."""
    m, lo, d = recipe.model, recipe.lora, recipe.data
    _require(bool(m.name), "model.name", "is empty", "set a hub id or a local folder")
    _require(m.max_seq_length > 0, "model.max_seq_length", "must be positive", "e.g. model.max_seq_length=1024")
    _require(0 < m.gpu_memory_utilization <= 1, "model.gpu_memory_utilization",
             f"is {m.gpu_memory_utilization}, outside (0, 1]", "e.g. model.gpu_memory_utilization=0.6")
    _require(lo.r > 0, "lora.r", f"is {lo.r}", "use a positive rank, e.g. lora.r=16")
    _require(lo.alpha > 0, "lora.alpha", f"is {lo.alpha}", "use a positive alpha, e.g. lora.alpha=32")
    _require(0 <= lo.dropout < 1, "lora.dropout", f"is {lo.dropout}", "use 0 <= dropout < 1")
    _require(bool(lo.target_modules), "lora.target_modules", "is empty", "name at least one module")
    # the adapter folder itself is checked by train, before the model loads
    _require(lo.init_adapter is None or bool(lo.init_adapter.strip()), "lora.init_adapter", "is empty",
             "give an adapter folder, or leave it unset (null) for a fresh LoRA")
    _require(lo.max_lora_rank is None or lo.max_lora_rank >= lo.r, "lora.max_lora_rank",
             f"{lo.max_lora_rank} is below lora.r={lo.r}", f"set lora.max_lora_rank>={lo.r} or leave it unset")
    _require(d.max_prompt_length > 0, "data.max_prompt_length", "must be positive", "e.g. data.max_prompt_length=256")
    _require(d.limit is None or d.limit > 0, "data.limit", f"is {d.limit}", "use a positive number or leave it unset")
    if d.source == "generated":
        _validate_generated(d.generated)
        _require(d.generated.eval_stories != "heldout" or d.eval_split == "test", "data.generated.eval_stories",
                 f"is heldout, but data.eval_split is {d.eval_split!r}: only the test split tells problems in "
                 "held-out wording", "set data.eval_split=test, or data.generated.eval_stories=all")
    else:
        _require(d.generated.grpo_levels is None, "data.generated.grpo_levels",
                 f"chooses among generated problems, but data.source is {d.source!r}",
                 "use data.source=generated, or leave data.generated.grpo_levels unset")
    # every source's rows are GSM8K solutions (sources.check_rows); other tasks' are not
    _require(not d.calculator or recipe.task == "gsm8k", "data.calculator", "completes GSM8K's `<<a-b=` calculator "
             f"annotations, but task is {recipe.task!r}, whose data has none", "set data.calculator=false, or "
             "task=gsm8k with data.source=generated, embedded, hub (openai/gsm8k) or a file of GSM8K rows")
    _validate_train(recipe, num_processes)
    p = recipe.prime
    for key in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"):
        _require(getattr(p, key) > 0, f"prime.{key}", f"is {getattr(p, key)}", "use a positive integer")
    _require(p.num_examples is None or p.num_examples > 0, "prime.num_examples", f"is {p.num_examples}",
             "use a positive number or leave it unset (all training problems)")
    _require(p.learning_rate > 0 and math.isfinite(p.learning_rate), "prime.learning_rate",
             f"is {p.learning_rate}", "use a positive learning rate, e.g. prime.learning_rate=2e-4")
    _require(0 <= p.warmup_ratio < 1, "prime.warmup_ratio", f"is {p.warmup_ratio}", "use 0 <= warmup_ratio < 1")
    if p.enabled:
        _require(recipe.task == "gsm8k", "prime.enabled", f"priming renders GSM8K solutions; task is {recipe.task!r}",
                 "set prime.enabled=false for other tasks")
        check_prefill(d.prefill)
    _validate_rewards(recipe)


def is_valid(recipe: Recipe) -> bool:
    """Whether `validate` accepts the recipe (a candidate setting tried by auto-fit or the OOM retry)."""
    try:
        validate(recipe)
    except RecipeError:
        return False
    return True


def _validate_train(recipe: Recipe, num_processes: int) -> None:
    m, d, t = recipe.model, recipe.data, recipe.train
    _require(t.num_generations >= 2, "train.num_generations", f"is {t.num_generations}; GRPO compares completions "
             "inside a group and needs at least 2", "set train.num_generations=2 or more (8 is typical)")
    gen_batch = t.generation_batch_size(num_processes)
    _require(gen_batch % t.num_generations == 0, "train.num_generations",
             f"the generation batch ({gen_batch} = per_device_train_batch_size {t.per_device_train_batch_size} x "
             f"{num_processes} process(es) x steps_per_generation {t.steps_per_generation_resolved()}) is not "
             f"divisible by num_generations={t.num_generations}",
             f"make train.per_device_train_batch_size a multiple of {t.num_generations}, or change "
             "train.num_generations to a divisor of the generation batch")
    total = d.max_prompt_length + t.max_completion_length
    _require(total <= m.max_seq_length, "model.max_seq_length",
             f"data.max_prompt_length ({d.max_prompt_length}) + train.max_completion_length "
             f"({t.max_completion_length}) = {total} exceeds model.max_seq_length ({m.max_seq_length})",
             f"raise model.max_seq_length to {total} or shorten the prompt or completion limit")
    for key in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
                "logging_steps", "save_steps", "save_total_limit"):
        value = getattr(t, key)
        _require(value > 0, f"train.{key}", f"is {value}", "use a positive integer")
    _require(t.learning_rate > 0 and math.isfinite(t.learning_rate), "train.learning_rate",
             f"is {t.learning_rate}", "use a positive learning rate, e.g. 5e-6")
    _require(0 <= t.warmup_ratio < 1, "train.warmup_ratio", f"is {t.warmup_ratio}", "use 0 <= warmup_ratio < 1")
    _require(t.temperature > 0, "train.temperature", f"is {t.temperature}", "use a positive temperature")
    _require(t.beta >= 0, "train.beta", f"is {t.beta}", "use beta >= 0 (0 disables the reference model)")
    _require(t.report_to in ("none", "tensorboard", "wandb", "trackio"), "train.report_to",
             f"is {t.report_to!r}", "use none, tensorboard, wandb or trackio")
    _require(t.completions_every >= 0, "train.completions_every", f"is {t.completions_every}",
             "use 0 (never) or a positive number of steps, e.g. train.completions_every=10")
    _require(t.preflight.prompts > 0, "train.preflight.prompts", f"is {t.preflight.prompts}",
             "use a positive number of prompts, e.g. train.preflight.prompts=16")
    e = t.eval
    _require(e.every >= 0, "train.eval.every", f"is {e.every}",
             "use 0 (never) or a positive number of steps, e.g. train.eval.every=10")
    _require(e.problems > 0, "train.eval.problems", f"is {e.problems}", "use a positive number of problems")
    _require(e.stage.problems >= 0, "train.eval.stage.problems", f"is {e.stage.problems}",
             "use 0 (off) or a number of held-out problems, e.g. train.eval.stage.problems=100")
    unknown = [s for s in e.stage.stages if s not in ("base", "start", "primed", "trained")]
    _require(not unknown, "train.eval.stage.stages", f"names unknown stage(s) {unknown}",
             "use some of base, start, primed, trained, e.g. train.eval.stage.stages=[base,primed,trained]")
    for key, value in (("eval.stage.samples", e.stage.samples), ("eval.samples", e.samples)):
        _require(value == 0 or value >= 2, f"train.{key}", f"is {value}; mean@k and pass@k need k >= 2 samples",
                 f"use 0 (greedy only) or e.g. train.{key}=4")
    _require(e.batch_size is None or e.batch_size >= 1, "train.eval.batch_size", f"is {e.batch_size}",
             "use a positive number of sequences, or leave it unset (null) for the memory plan's")
    _require(t.memory.oom_retries >= 0, "train.memory.oom_retries", f"is {t.memory.oom_retries}",
             "use 0 (stop at the first OOM) or more")
    _require(0 <= t.max_truncated_targets <= 1, "train.max_truncated_targets", f"is {t.max_truncated_targets}",
             "use a share in [0, 1], e.g. 0.02 (1 = never check)")
    for key, owner in MANAGED_TRAINER_FIELDS.items():
        _require(key not in t.extra, f"train.{key}", "is set by lowmem_grpo", f"set {owner} instead")


def _validate_generated(g: GeneratedDataConfig) -> None:
    from lowmem_grpo.data.generated import TASKS, parse_levels, parse_operations

    _require(g.task in TASKS, "data.generated.task", f"is {g.task!r}", f"use one of {', '.join(TASKS)}")
    try:
        levels = parse_levels(g.levels)
    except DataError as exc:
        raise RecipeError(f"data.generated.levels: {exc}", fix='e.g. data.generated.levels="1-3"') from exc
    if g.grpo_levels is not None:
        try:
            grpo = parse_levels(g.grpo_levels)
        except DataError as exc:
            raise RecipeError(f"data.generated.grpo_levels: {exc}", fix='e.g. data.generated.grpo_levels="2"') from exc
        outside = sorted(set(grpo) - set(levels))
        _require(not outside, "data.generated.grpo_levels",
                 f"names level(s) {', '.join(map(str, outside))} that data.generated.levels ({g.levels}) does not draw",
                 "name some of data.generated.levels, or add the level there")
    try:
        parse_operations(g.operations)
    except DataError as exc:
        raise RecipeError(f"data.generated.operations: {exc}", fix="e.g. data.generated.operations=add,sub") from exc
    for key in ("train_size", "test_size"):
        _require(getattr(g, key) > 0, f"data.generated.{key}", f"is {getattr(g, key)}", "use a positive size")


def _validate_rewards(recipe: Recipe) -> None:
    from lowmem_grpo.rewards import GSM8K_DEFAULT_WEIGHTS, get_reward

    rewards = recipe.rewards or (GSM8K_DEFAULT_WEIGHTS if recipe.task == "gsm8k" else {})
    _require(bool(rewards), "rewards", "no reward functions are configured", "add e.g. rewards.correctness=2.0")
    for name, weight in rewards.items():
        _require(isinstance(weight, (int, float)) and math.isfinite(weight), f"rewards.{name}",
                 f"weight {weight!r} is not a finite number", "use a number, e.g. 0.5")
        try:
            get_reward(name)
        except (KeyError, ValueError, ImportError) as exc:
            raise RecipeError(f"rewards.{name}: {exc}", fix="use a registered name or package.module:function") from exc
    if recipe.goal_reward is not None:
        _require(recipe.goal_reward in rewards, "goal_reward", f"{recipe.goal_reward!r} is not one of the rewards "
                 f"({', '.join(rewards)})", f"add rewards.{recipe.goal_reward}, or name one of "
                 f"{', '.join(rewards)} as goal_reward")
