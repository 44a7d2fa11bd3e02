"""Groups that teach: pass rates, the curriculum, the sampler's layout and draws (units), and tiny-model runs
where a flat group is kept out of the loss, the metrics are logged, and a resumed run draws what an
uninterrupted one does."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from lowmem_grpo.train.informative import (Curriculum, PassRates, SamplingState, informative_probability,
                                           weighted_sample)
from resilience_helpers import CPU_RECIPE, adapter_tensors, cli_inprocess, metrics, one_torch_thread  # noqa: F401

FLAT_ON_EVEN = "rewards={correctness: 2.0, 'lowmem_test_rewards:length_on_odd_ids': 1.0}"


# ---- pass rates and the curriculum (pure) ---------------------------------------------------------------

def test_pass_rate_is_the_beta_1_1_posterior_mean_over_a_window_and_weights_follow_it():
    rates = PassRates(group_size=4, window=5)
    assert rates.rate(7) == 0.5 and rates.weight(7) == pytest.approx(1 - 2 * 0.5**4)  # unseen: the largest weight
    rates.update([7, 7, 7, 9], [True, True, False, None])  # None (unscored) is skipped
    assert rates.rate(7) == pytest.approx(3 / 5) and rates.rate(9) == 0.5
    assert rates.weight(7) == pytest.approx(1 - 0.6**4 - 0.4**4)
    rates.update([7] * 5, [True] * 5)  # the window keeps the last 5 outcomes only
    assert rates.rate(7) == pytest.approx(6 / 7)
    assert informative_probability(1.0, 8) == 0.0 == informative_probability(0.0, 8)
    floored = PassRates(group_size=8, window=64, floor=0.3)
    floored.update([1] * 64, [False] * 64)
    assert floored.weight(1) == 0.3


def test_a_problem_seen_rarely_is_judged_by_its_levels_recent_pass_rate():
    rates = PassRates(group_size=8, window=16, levels=[1, 1, 1, 2, 2, 2])
    assert rates.prior(0) == 0.5 == rates.rate(4)  # nothing seen: Beta(1,1)
    rates.update([0] * 8 + [3] * 8, [True] * 8 + [True, False] * 4)  # level 1 solved, level 2 half the time
    assert rates.prior(1) == pytest.approx(9 / 10) and rates.prior(5) == pytest.approx(5 / 10)
    assert rates.rate(1) == pytest.approx(0.9)  # unseen problem 1 takes level 1's rate
    assert rates.rate(0) == pytest.approx((8 + 1.8) / 10)  # its own outcomes and two at the level's rate
    weights = rates.weights([1, 2, 4, 5])
    assert weights == [pytest.approx(rates.weight(i)) for i in (1, 2, 4, 5)]
    assert weights[2] > 1.5 * weights[0]  # the band the model sometimes solves is drawn more
    again = PassRates(group_size=8, window=16, levels=[1, 1, 1, 2, 2, 2])
    again.load_state_dict(json.loads(json.dumps(rates.state_dict())))
    assert [again.rate(i) for i in range(6)] == [rates.rate(i) for i in range(6)]


def test_pass_rates_state_round_trips_through_json():
    rates = PassRates(group_size=8, window=4)
    rates.update([0, 0, 3, 3, 3, 3, 3], [True, False, True, True, False, True, True])
    again = PassRates(group_size=8, window=4)
    again.load_state_dict(json.loads(json.dumps(rates.state_dict())))
    assert {i: again.rate(i) for i in range(5)} == {i: rates.rate(i) for i in range(5)}
    again.update([3], [False])  # the restored windows keep their length limit
    assert list(again.history[3]) == [0, 1, 1, 0]


def test_curriculum_moves_up_when_the_pass_rate_crosses_its_threshold_and_not_before():
    cur = Curriculum([3, 1, 2], promote_at=0.6, window=8)
    assert cur.level == 1 and cur.allows(1) and not cur.allows(2)
    assert not cur.update([1] * 7, [True] * 7)  # above the threshold, but fewer outcomes than the window
    assert not cur.update([2] * 8, [True] * 8)  # outcomes on another level do not count
    cur = Curriculum([1, 2, 3], promote_at=0.6, window=8)
    assert not cur.update([1] * 8, [True, False] * 4) and cur.pass_rate() == 0.5
    assert not cur.update([1], [True])  # the last 8: F T F T F T F T, still 0.5
    assert cur.update([1], [True])  # T F T F T F T T: 5 of 8 = 0.625 crosses 0.6
    assert cur.level == 2 and cur.pass_rate() is None  # the new level's rate starts from its own outcomes
    assert cur.allows(1) and cur.allows(2) and not cur.allows(3)
    assert cur.update([2] * 8, [True] * 8) and cur.level == 3
    assert not cur.update([3] * 8, [True] * 8) and cur.level == 3  # the top level stays
    again = Curriculum([1, 2, 3], promote_at=0.6, window=8)
    again.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    assert again.level == 3 and list(again.recent) == list(cur.recent)


def test_the_curriculum_pool_holds_the_levels_up_to_the_current_one():
    levels = [1, 2, 1, 3, 2, 1]
    state = SamplingState(levels, seed=0, curriculum=Curriculum([1, 2, 3], 0.5, window=2))
    assert state.pool() == [0, 2, 5] and state.level == 1
    for c in range(20):
        assert set(state.chunk(c, 2)) <= {0, 2, 5}
    assert state.observe([0, 2], [True, True]) and state.level == 2
    assert state.pool() == [0, 1, 2, 4, 5]


# ---- draws and the sampler ----------------------------------------------------------------------------------

def test_weighted_sample_takes_distinct_items_and_fills_a_small_pool_with_repeats():
    rng = random.Random(0)
    chosen = weighted_sample(list(range(10)), [1.0] * 10, 4, rng)
    assert len(set(chosen)) == 4
    small = weighted_sample([3, 5], [1.0, 1.0], 5, rng)
    assert sorted(small[:2]) == [3, 5] and len(small) == 5 and set(small) <= {3, 5}


def test_sampler_layout_equals_repeat_samplers_with_uniform_weights():
    from trl.trainer.utils import RepeatSampler

    from lowmem_grpo.train.trainer import InformativeSampler

    for rates in (None, PassRates(group_size=2, window=8)):  # no observation yet: every weight is equal
        state = SamplingState([0] * 7, seed=3, rates=rates)
        sampler = InformativeSampler(state, num_chunks=7 // 3, batch_size=3, mini_repeat_count=2, repeat_count=4)
        drawn = list(sampler)
        flat = [i for chunk in state.drawn for i in chunk]
        assert len(state.drawn) == 2 and all(len(set(c)) == 3 for c in state.drawn)
        reference = RepeatSampler(list(range(6)), mini_repeat_count=2, batch_size=3, repeat_count=4, shuffle=False)
        assert drawn == [flat[i] for i in reference]  # each prompt twice in a row, each chunk 4 times, in order
        assert len(sampler) == len(drawn) == len(RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3,
                                                              repeat_count=4))


def test_sampler_is_seeded_deterministic_and_replays_what_it_drew():
    from lowmem_grpo.train.trainer import InformativeSampler

    def run(seed: int, state: SamplingState | None = None) -> list[int]:
        state = state or SamplingState([0] * 20, seed=seed, rates=PassRates(4, 16))
        sampler = InformativeSampler(state, num_chunks=5, batch_size=4, mini_repeat_count=4, repeat_count=1)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out += list(sampler)
        return out

    assert run(1) == run(1) and run(1) != run(2)
    state = SamplingState([0] * 20, seed=1, rates=PassRates(4, 16))
    first = run(1, state)
    state.rates.update(list(range(10)) * 8, [False] * 80)  # the weights change after the draws ...
    assert run(1, state) == first  # ... but chunks already drawn are replayed as they were
    resumed = SamplingState([0] * 20, seed=1, rates=PassRates(4, 16))
    resumed.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert run(1, resumed) == first


def test_weights_move_draws_away_from_problems_always_or_never_solved():
    rates = PassRates(group_size=8, window=32)
    for i in range(12):  # 0-3 always solved, 4-7 never, 8-11 half the time
        rates.update([i] * 32, [True] * 32 if i < 4 else [False] * 32 if i < 8 else [True, False] * 16)
    state = SamplingState([0] * 12, seed=0, rates=rates)
    counts = Counter(i for c in range(600) for i in state.chunk(c, 2))
    extreme, middle = sum(counts[i] for i in range(8)) / 8, sum(counts[i] for i in range(8, 12)) / 4
    assert middle > 3 * extreme, counts
    uniform = SamplingState([0] * 12, seed=0)
    counts = Counter(i for c in range(600) for i in uniform.chunk(c, 2))
    assert max(counts.values()) < 1.5 * min(counts.values())


def test_problem_columns_carry_the_generated_level():
    from lowmem_grpo.data import with_problem_columns
    from lowmem_grpo.data.generated import generate_rows

    rows = generate_rows("train", 6, 2, seed=5) + generate_rows("train", 6, 3, seed=5)
    examples = [{"question": r["question"], "solution": r["answer"], "prompt": r["question"]} for r in rows]
    tagged = with_problem_columns(examples, generated=True)
    assert [e["problem_id"] for e in tagged] == list(range(12))
    assert [e["level"] for e in tagged] == [2] * 6 + [3] * 6
    assert {e["level"] for e in with_problem_columns(examples, generated=False)} == {0}


def test_a_curriculum_needs_a_correctness_reward():
    from lowmem_grpo.errors import RecipeError
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.recipe_rules import validate

    validate(load_recipe(str(CPU_RECIPE), ["data.source=generated", "train.selection.curriculum=true"]))
    with pytest.raises(RecipeError, match="train.selection.curriculum"):
        validate(load_recipe(str(CPU_RECIPE), ["data.source=generated", "train.selection.curriculum=true",
                                               "rewards={'lowmem_test_rewards:length_reward': 1.0}"]))


def test_console_line_and_report_show_the_informative_share_and_the_level(tmp_path):
    from lowmem_grpo.rundir.plots import plot_all
    from lowmem_grpo.rundir.report import groups_lines
    from lowmem_grpo.rundir.telemetry import console_line

    records = [{"step": s, "reward": 0.5, "frac_reward_zero_std": 1 - g, "groups/informative": g,
                "groups/informative_goal": g / 2, "groups/per_step": 2.0, "curriculum/level": lv}
               for s, g, lv in ((1, 0.5, 1.0), (2, 1.0, 1.0), (3, 0.5, 2.0))]
    line = console_line(records[-1], 3, 10, 30.0, [])
    assert "informative 0.50" in line and "level 2" in line
    lines = groups_lines(records)
    assert lines[0].startswith("- informative groups (total reward varies): mean 0.6667 over 3 steps")
    assert "on the goal reward alone: 0.3333" in lines[0] and "2 prompt groups per step" in lines[0]
    assert lines[1] == "- curriculum: level 1 at the start, 2 at the end (moved up: 2 at step 3)"
    assert groups_lines([{"step": 1, "reward": 0.1}]) == []
    assert tmp_path / "groups.png" in plot_all(records, tmp_path)


# ---- tiny-model runs ----------------------------------------------------------------------------------------

def _tiny_recipe(model_dir: Path, run_dir: Path, *extra: str):
    from lowmem_grpo.recipe_io import load_recipe

    return load_recipe(str(CPU_RECIPE), [
        f"model.name={model_dir}", "model.backend=hf", f"output.dir={run_dir}", "prime.enabled=false",
        "train.preflight.enabled=false", "train.max_completion_length=16", "train.max_truncated_targets=1",
        "train.mask_truncated_completions=false", "train.num_generations=4",
        "train.per_device_train_batch_size=8", "train.save_steps=10", "train.completions_every=0", FLAT_ON_EVEN,
        *extra])


def _trainer(model_dir: Path, run_dir: Path, *extra: str):
    """A GRPO trainer built as train() builds it (trainer_factory), on the tiny model."""
    from datasets import Dataset

    from lowmem_grpo.backends import load, start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.recipe import goal_reward_name, resolved_rewards
    from lowmem_grpo.rewards import get_reward
    from lowmem_grpo.train.informative import prepare_sampling

    recipe = _tiny_recipe(model_dir, run_dir, *extra)
    loaded = load(recipe, start(recipe, Launch())[0], model_path=str(model_dir))
    examples, sampling = prepare_sampling(recipe, recipe_examples(load_train_rows(recipe.data), loaded.tokenizer,
                                                                  recipe.data))
    from lowmem_grpo.train.grpo import trainer_factory

    weights = resolved_rewards(recipe)
    build = trainer_factory(loaded, Dataset.from_list(examples), run_dir, [get_reward(n) for n in weights],
                            list(weights.values()), [], sampling=sampling, goal=goal_reward_name(recipe))
    return build(recipe), loaded, examples, sampling


@pytest.mark.slow
def test_the_trainer_draws_through_the_sampling_state_only_with_an_option(tiny_model_dir, tmp_path):
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer, LowmemGRPOTrainer, grpo_trainer_class

    trainer, _, examples, sampling = _trainer(tiny_model_dir, tmp_path, "data.limit=4")
    assert type(trainer) is CpuSafeGRPOTrainer and sampling is None
    assert set(examples[0]) == {"prompt", "answer", "question", "solution", "prefill"}  # no extra columns
    assert trainer.lowmem_sampling is None and not trainer.lowmem_dynamic_sampling
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe import Recipe
    from lowmem_grpo.recipe_io import apply_overrides
    from lowmem_grpo.runtime import resolve

    gpu = CudaFacts(torch_cuda="12.6", available=True, capability=(8, 6))
    on_gpu = {b: resolve(apply_overrides(Recipe(), [f"model.backend={b}"]), Launch(), gpu) for b in ("unsloth", "hf")}
    assert grpo_trainer_class(on_gpu["unsloth"]) is LowmemGRPOTrainer is grpo_trainer_class(on_gpu["hf"])
    trainer, _, examples, sampling = _trainer(tiny_model_dir, tmp_path, "data.limit=4", "train.selection.dynamic_sampling=true")
    assert type(trainer) is CpuSafeGRPOTrainer and trainer.lowmem_sampling is sampling
    assert [e["problem_id"] for e in examples] == [0, 1, 2, 3] and {e["level"] for e in examples} == {0}


@pytest.mark.slow
def test_a_flat_group_is_kept_out_of_the_loss_and_the_step_still_trains(tiny_model_dir, tmp_path):
    """Two problems per step (8 rows, 4 generations): the even one's group is flat (correctness 0, the other
    reward 0), the odd one's varies. Its rows are masked, the LoRA weights still move, and groups/informative =
    1 - frac_reward_zero_std = 0.5."""
    import torch

    trainer, loaded, _, sampling = _trainer(tiny_model_dir, tmp_path, "data.limit=2", "train.max_steps=2",
                                            "train.selection.dynamic_sampling=true")
    seen = []
    scored = trainer._generate_and_score_completions

    def spy(inputs):
        out = scored(inputs)
        seen.append(([x["problem_id"] for x in inputs], out["completion_mask"].clone()))
        return out

    trainer._generate_and_score_completions = spy
    lora = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    trainer.train()

    assert len(seen) == 2
    for ids, mask in seen:
        assert sorted(set(ids)) == [0, 1]
        masked = (mask.sum(dim=1) == 0).tolist()
        assert all(masked[i] for i, pid in enumerate(ids) if pid % 2 == 0)  # every row of the flat (even) group
    moved = [n for n, p in loaded.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert moved
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["groups/informative"] == pytest.approx(1 - h["frac_reward_zero_std"]) == pytest.approx(0.5)
        assert h["groups/informative_goal"] == 0.0  # a random model never answers correctly
        assert h["groups/per_step"] == 2.0
        assert h["optimizer/skipped_no_signal"] == 0.0  # one group varied: the step is taken
    assert sorted(sampling.rates.history) == [0, 1] and len(sampling.rates.history[0]) == 8


@pytest.mark.slow
def test_masking_flat_groups_leaves_the_loss_normaliser_at_the_whole_batch(tiny_model_dir, tmp_path):
    """num_items_in_batch (the dapo normaliser) is the token count TRL made for the whole batch, before and after
    the flat group's rows are masked: counting the informative rows only would scale the step's loss by 1 / (their
    share of the tokens), so a step's size would follow how many groups happened to vary."""
    trainer, _, _, _ = _trainer(tiny_model_dir, tmp_path, "data.limit=2", "train.max_steps=2",
                                "train.selection.dynamic_sampling=true")
    seen = []
    exclude = trainer._exclude_flat_groups

    def spy(output, rows):
        before = (int(output["num_items_in_batch"]), int(output["completion_mask"].sum()))
        out = exclude(output, rows)
        seen.append((*before, int(out["num_items_in_batch"]), int(out["completion_mask"].sum())))
        return out

    trainer._exclude_flat_groups = spy
    trainer.train()
    assert len(seen) == 2
    for trl_items, tokens_before, items_after, tokens_after in seen:
        assert trl_items == tokens_before  # TRL counted every row's tokens
        assert tokens_after < tokens_before  # the flat group's rows are out of the loss ...
        assert items_after == trl_items  # ... and the normaliser is the whole batch's, as without masking


@pytest.mark.slow
def test_a_batch_without_an_informative_group_moves_no_weight(tiny_model_dir, tmp_path):
    """Correctness alone on a random model: every group is flat, every advantage 0. Without dynamic sampling too,
    the optimizer does not step (AdamW's weight decay would shrink lora_A, its momentum would carry old steps), and
    each step logs optimizer/skipped_no_signal = 1."""
    import torch

    trainer, loaded, _, sampling = _trainer(tiny_model_dir, tmp_path, "data.limit=2", "train.max_steps=2",
                                            "rewards={correctness: 2.0}", "train.weight_decay=0.1")
    assert sampling is None  # the plain trainer
    lora = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = [n for n, p in loaded.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert moved == []
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(h["frac_reward_zero_std"] == 1.0 for h in logged)
    assert [h["optimizer/skipped_no_signal"] for h in logged] == [1.0, 1.0]
    assert trainer.state.global_step == 2  # the steps still count (and the schedule moves on)


@pytest.mark.slow
def test_the_loader_reads_one_chunk_ahead_of_the_rewards(tiny_model_dir, tmp_path):
    """What the sampler really sees: the trainer's loader fetches the next generation batch before it yields the
    current one, so chunk c is drawn after the outcomes of chunk c-2 are recorded but before those of chunk c-1
    (within an epoch: the first chunk of the next one is drawn when the last one was scored)."""
    trainer, _, _, sampling = _trainer(tiny_model_dir, tmp_path, "data.limit=10", "train.max_steps=4",
                                       "train.selection.dynamic_sampling=true")
    events = []
    chunk, observe = sampling.chunk, sampling.observe

    def chunk_spy(index, size):
        events.append(("draw", index))
        return chunk(index, size)

    def observe_spy(ids, passed):
        events.append(("observe", None))
        return observe(ids, passed)

    sampling.chunk, sampling.observe = chunk_spy, observe_spy
    trainer.train()
    observed_before = {}
    count = 0
    for kind, index in events:
        if kind == "observe":
            count += 1
        elif index not in observed_before:
            observed_before[index] = count
    assert count == 4  # one scored chunk per step
    # chunk c (c >= 1) was drawn when c - 1 chunks had been scored: one chunk behind
    assert [observed_before[c] for c in range(1, 4)] == [0, 1, 2]


@pytest.mark.slow
def test_when_every_group_is_flat_the_batch_is_left_as_it_is(tiny_model_dir, tmp_path):
    trainer, _, _, _ = _trainer(tiny_model_dir, tmp_path, "data.limit=2", "train.max_steps=1",
                                "train.selection.dynamic_sampling=true", "rewards={correctness: 2.0}")
    seen = []
    scored = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(scored(inputs)) or seen[-1]
    trainer.train()
    out = seen[0]
    assert bool((out["completion_mask"].sum(dim=1) > 0).all())  # no row masked: nothing to weigh them against
    assert int(out["num_items_in_batch"]) == int(out["completion_mask"].sum())
    assert trainer.state.log_history[0]["groups/informative"] == 0.0
    assert trainer.state.log_history[0]["optimizer/skipped_no_signal"] == 1.0  # and no optimizer step


def _run_args(model_dir: Path, run_dir: Path) -> list[str]:
    return ["train", str(CPU_RECIPE), f"model.name={model_dir}", "model.backend=hf", f"output.dir={run_dir}",
            "prime.enabled=false", "train.preflight.enabled=false", "train.max_completion_length=16",
            "train.max_truncated_targets=1", "train.mask_truncated_completions=false", "train.num_generations=4", "train.per_device_train_batch_size=8", "train.max_steps=4",
            "train.save_steps=1", "train.completions_every=1", FLAT_ON_EVEN, "data.source=generated",
            "data.generated.levels=1-2", "data.generated.train_size=8", "train.selection.dynamic_sampling=true",
            "train.selection.curriculum=true"]


@pytest.mark.slow
def test_dynamic_sampling_and_curriculum_run_logs_saves_its_state_and_resumes_exactly(tiny_model_dir, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    code, log = cli_inprocess(*_run_args(tiny_model_dir, reference))
    assert code == 0, log[-3000:]
    steps = [m for m in metrics(reference) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert m["groups/informative"] == pytest.approx(1 - m["frac_reward_zero_std"])
        assert m["curriculum/level"] == 1.0 and m["groups/per_step"] == 2.0
    assert "informative " in log and "level 1" in log  # the console line
    report = (reference / "report.md").read_text()
    assert "## Groups that teach" in report and (reference / "plots" / "groups.png").exists()
    marker = json.loads((reference / "checkpoint-4" / "lowmem_complete.json").read_text())
    assert "lowmem_sampling.json" in json.dumps(marker)  # written before the checkpoint was marked complete
    state = json.loads((reference / "checkpoint-4" / "lowmem_sampling.json").read_text())
    assert state["curriculum"]["level"] == 1 and len(state["drawn"]) >= 4

    code, log = cli_inprocess(*_run_args(tiny_model_dir, run), faults=["sigint@2"])
    assert code == 130, log[-3000:]
    code, log = cli_inprocess("train", "--resume", str(run))
    assert code == 0, log[-3000:]
    assert "sampling state restored from checkpoint-2" in log
    ours = [m for m in metrics(run) if "reward" in m]
    for key in ("reward", "groups/informative", "curriculum/level"):
        assert [m[key] for m in ours] == [m[key] for m in steps], key
    assert json.loads((run / "checkpoint-4" / "lowmem_sampling.json").read_text()) == state
    a, b = adapter_tensors(run / "adapter"), adapter_tensors(reference / "adapter")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


class _StubAccelerator:
    num_processes = 1


class _StubModel:
    training = True


class _StubTrainer:
    """What NoSignalStepGuard touches of a trainer (lowmem_grpo.train.trainer.LowmemGRPOTrainer): add_callback,
    optimizer, accelerator, add_step_metrics; its compute_loss hands each training micro-batch to the guard."""

    def __init__(self, optimizer) -> None:
        from collections import defaultdict

        self.optimizer = optimizer
        self.accelerator = _StubAccelerator()
        self.model = _StubModel()
        self.metrics = defaultdict(list)
        self.callbacks = []
        self.lowmem_guard = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.lowmem_guard.judge(inputs)
        return 0.0

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def add_step_metrics(self, record) -> None:
        for key, value in record.items():
            self.metrics[key].append(value)


def test_the_guard_skips_a_step_without_signal_and_steps_when_it_cannot_judge():
    import torch

    from lowmem_grpo.train.callbacks import SKIPPED_STEP_KEY, NoSignalStepGuard

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.zeros(3)
    trainer = _StubTrainer(torch.optim.AdamW([weight], lr=0.1, weight_decay=0.5))
    guard = NoSignalStepGuard.attach(trainer)
    assert trainer.callbacks == [guard] and trainer.lowmem_guard is guard
    guard.on_train_begin(None, None, None)
    flat = {"advantages": torch.zeros(4), "completion_mask": torch.ones(4, 5)}
    cut = {"advantages": torch.tensor([0.0, 1.0, -1.0, 0.0]), "completion_mask": torch.tensor([[1] * 5, [0] * 5,
                                                                                               [0] * 5, [1] * 5])}
    varied = {"advantages": torch.tensor([0.0, 1.0, -1.0, 0.0]), "completion_mask": torch.ones(4, 5)}
    for batch in (flat, cut):  # all advantages 0; the varied rows all cut off and masked
        trainer.compute_loss(None, batch)
        trainer.optimizer.step()
        assert torch.equal(weight.detach(), torch.ones(3))  # weight decay did not touch it
    trainer.compute_loss(None, flat)
    trainer.compute_loss(None, varied)  # one micro-batch of the accumulation window varies: the step is taken
    trainer.optimizer.step()
    assert not torch.equal(weight.detach(), torch.ones(3))
    moved = weight.detach().clone()
    trainer.optimizer.step()  # no micro-batch went through compute_loss: nothing judged, the step is taken
    assert not torch.equal(weight.detach(), moved)
    assert trainer.metrics[SKIPPED_STEP_KEY] == [1.0, 1.0, 0.0, 0.0] and guard.skipped == 2
