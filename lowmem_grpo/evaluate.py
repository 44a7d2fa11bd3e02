"""Generation + metrics for GSM8K evaluation: `run_eval` (the shared API) and the periodic-eval callback.

`run_eval(model, tokenizer, examples)` generates completions for prompts built by
`lowmem_grpo.data.build_examples` (greedy by default, seeded sampling otherwise), scores
prefill + generated text with `lowmem_grpo.eval_metrics`, and returns an EvalResult. It generates
with vLLM when given a vLLM engine (a `vllm.LLM`, or an Unsloth model with `fast_generate`) and
CUDA is present, else with batched transformers `generate` (left padding).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.eval_metrics import Verdict, aggregate, judge, weighted_rewards

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generated completion: its text (without the prefill), token count, and whether it was cut."""

    text: str
    tokens: int
    truncated: bool


@dataclass
class EvalResult:
    """Metrics over the problems, one record per problem, and how it was run."""

    metrics: dict[str, float]
    """strict_accuracy, lenient_accuracy, strict_format_rate, soft_format_rate, mean_completion_tokens,
    truncated_rate, num_problems, num_completions; pass@k, mean@k, lenient_pass@k when k > 1;
    reward (weighted total) and reward/<name> when reward_weights were given."""
    records: list[dict[str, Any]]
    """Per problem: index, question, gold, and the first sample's completion, extracted_answer,
    last_number, verdicts, truncated, completion_tokens (and rewards); `samples` holds all k when k > 1."""
    verdicts: list[list[Verdict]] = field(default_factory=list)
    """Per problem, the verdict of each sample (what `eval_metrics.compare` takes)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """max_new_tokens, batch_size, num_samples, temperature, seed, engine."""
    seconds: float = 0.0
    """Wall time of generation and scoring."""

    @property
    def problems_per_minute(self) -> float:
        return 60.0 * len(self.records) / self.seconds if self.seconds > 0 else float("nan")


def _is_vllm_engine(model: Any) -> bool:
    """A vLLM engine (or an Unsloth fast_inference model) that can generate on CUDA."""
    from lowmem_grpo.device import is_installed

    if not is_installed("vllm"):
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    if hasattr(model, "fast_generate"):
        return True
    return type(model).__module__.startswith("vllm")


def choose_engine(model: Any, engine: str = "auto") -> str:
    """auto -> vllm for a vLLM engine when vllm and CUDA are present, else transformers."""
    if engine not in ("auto", "vllm", "transformers"):
        raise BadInputError(f"engine {engine!r} is unknown", fix="use auto, vllm or transformers")
    if engine == "auto":
        return "vllm" if _is_vllm_engine(model) else "transformers"
    if engine == "vllm" and not _is_vllm_engine(model):
        raise BadInputError("engine vllm needs vllm installed, CUDA, and a vLLM engine as the model",
                            fix="install vllm on a CUDA machine, or use engine=transformers")
    return engine


def split_generated(ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], int, bool]:
    """Generated ids -> (ids before the first EOS, tokens generated incl. EOS, truncated).

    Truncated means the generation reached max_new_tokens without an EOS; padding after an EOS
    (a finished row in a batch) is not counted.
    """
    end = next((j for j, t in enumerate(ids) if t in eos), None)
    if end is None:
        return list(ids), len(ids), len(ids) >= max_new_tokens
    return list(ids[:end]), end + 1, False


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _generation_config(model: Any, tokenizer: Any, max_new_tokens: int, num_samples: int,
                       temperature: float, eos: set[int]) -> Any:
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    sample = temperature > 0
    # Plain sampling at the given temperature (no top-k/top-p), like TRL's defaults; greedy otherwise.
    config.update(do_sample=sample, temperature=temperature if sample else 1.0, top_p=1.0,
                  top_k=0 if sample else 50, min_p=None, repetition_penalty=1.0, num_return_sequences=num_samples, max_new_tokens=max_new_tokens,
                  max_length=None, min_new_tokens=None, eos_token_id=sorted(eos),
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos))
    return config


def _generate_transformers(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int,
                           batch_size: int, num_samples: int, temperature: float, seed: int,
                           bar: Any) -> list[list[Generation]]:
    import torch

    eos = _eos_ids(model, tokenizer)
    if not eos:
        raise BadInputError("the tokenizer has no EOS token, so truncation cannot be told from an end",
                            fix="set tokenizer.eos_token (and the model's generation_config.eos_token_id)")
    config = _generation_config(model, tokenizer, max_new_tokens, num_samples, temperature, eos)
    device = next(model.parameters()).device
    per_batch = max(1, batch_size // num_samples)  # batch_size counts sequences generated at once
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    results: list[list[Generation]] = []
    try:
        for start in range(0, len(prompts), per_batch):
            batch = prompts[start:start + per_batch]
            encoded = tokenizer(batch, return_tensors="pt", padding=True).to(device)
            with torch.inference_mode():
                out = model.generate(**encoded, generation_config=config)
            generated = out[:, encoded["input_ids"].shape[1]:].tolist()
            for i in range(len(batch)):
                samples = []
                for ids in generated[i * num_samples:(i + 1) * num_samples]:
                    kept, tokens, truncated = split_generated(ids, eos, max_new_tokens)
                    samples.append(Generation(tokenizer.decode(kept, skip_special_tokens=True), tokens, truncated))
                results.append(samples)
            bar.update(len(batch))
    finally:
        tokenizer.padding_side = padding_side
        if was_training:
            model.train()
    return results


def _generate_vllm(engine: Any, prompts: list[str], *, max_new_tokens: int, num_samples: int,
                   temperature: float, seed: int, lora_request: Any, bar: Any) -> list[list[Generation]]:
    """vLLM generation (not exercised by the CPU test suite: vllm needs CUDA)."""
    from vllm import SamplingParams

    params = SamplingParams(n=num_samples, temperature=temperature, top_p=1.0, top_k=-1 if temperature else 1,
                            max_tokens=max_new_tokens, seed=seed)
    generate = getattr(engine, "fast_generate", None) or engine.generate
    outputs = generate(prompts, sampling_params=params, lora_request=lora_request, use_tqdm=False)
    bar.update(len(prompts))
    return [[Generation(text=o.text, tokens=len(o.token_ids), truncated=o.finish_reason == "length")
             for o in out.outputs] for out in outputs]


def generate(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 256, batch_size: int = 8,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0, progress: bool = True,
             engine: str = "auto", lora_request: Any = None, desc: str = "eval") -> list[list[Generation]]:
    """num_samples completions per prompt (text after the prompt, prefill excluded)."""
    if max_new_tokens < 1 or batch_size < 1 or num_samples < 1:
        raise BadInputError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}, num_samples={num_samples}:"
                            " each must be at least 1", fix="use positive values")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise BadInputError(f"temperature={temperature} must be >= 0", fix="use 0 for greedy or e.g. 0.7")
    if num_samples > 1 and temperature == 0:
        raise BadInputError(f"{num_samples} samples per problem at temperature 0 would all be the same greedy text",
                            fix="set a sampling temperature (e.g. --temperature 0.7) or use 1 sample")
    from tqdm.auto import tqdm

    chosen = choose_engine(model, engine)
    with tqdm(total=len(prompts), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True) as bar:
        if chosen == "vllm":
            return _generate_vllm(model, prompts, max_new_tokens=max_new_tokens, num_samples=num_samples,
                                  temperature=temperature, seed=seed, lora_request=lora_request, bar=bar)
        return _generate_transformers(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                      batch_size=batch_size, num_samples=num_samples, temperature=temperature,
                                      seed=seed, bar=bar)


def _record(index: int, example: dict[str, Any], verdicts: list[Verdict],
            rewards: list[dict[str, float]] | None) -> dict[str, Any]:
    samples = []
    for j, verdict in enumerate(verdicts):
        sample = verdict.as_dict()
        if rewards is not None:
            sample["rewards"] = rewards[j]
        samples.append(sample)
    record = {"index": index, "question": example.get("question"), "gold": example["answer"], **samples[0]}
    if len(samples) > 1:
        record["samples"] = samples
        record["pass_strict"] = any(v.strict_correct for v in verdicts)
        record["pass_lenient"] = any(v.lenient_correct for v in verdicts)
    return record


def run_eval(model: Any, tokenizer: Any, examples: list[dict[str, Any]], *,
             reward_weights: dict[str, float] | None = None, max_new_tokens: int = 256, batch_size: int = 8,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0, progress: bool = True,
             engine: str = "auto", lora_request: Any = None) -> EvalResult:
    """Generate for each example (from `build_examples`: prompt, answer, prefill, question) and score it.

    Greedy when temperature is 0 (the default); seeded sampling of num_samples completions per
    problem otherwise. batch_size counts sequences generated at once. The same seed and settings
    give the same result. With reward_weights, each reward's mean and the weighted total
    (`reward`) are added to the metrics, scored the way TRL calls rewards.
    """
    if not examples:
        raise BadInputError("no problems to evaluate", fix="check the data source, split and --limit")
    started = time.monotonic()
    prompts = [ex["prompt"] for ex in examples]
    generations = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           num_samples=num_samples, temperature=temperature, seed=seed, progress=progress,
                           engine=engine, lora_request=lora_request)
    per_problem: list[list[Verdict]] = []
    records = []
    reward_sums: dict[str, float] = {}
    for index, (example, samples) in enumerate(zip(examples, generations)):
        prefill = example.get("prefill") or ""
        verdicts = [judge(prefill + g.text, example["answer"], truncated=g.truncated, completion_tokens=g.tokens)
                    for g in samples]
        rewards = None
        if reward_weights:
            columns = {k: [v] * len(samples) for k, v in example.items()}
            columns["prompts"] = columns.pop("prompt")
            scores = weighted_rewards(reward_weights, [g.text for g in samples], columns)
            rewards = [{name: values[j] for name, values in scores.items()} for j in range(len(samples))]
            for name, values in scores.items():
                reward_sums[name] = reward_sums.get(name, 0.0) + sum(v for v in values if math.isfinite(v))
        per_problem.append(verdicts)
        records.append(_record(index, example, verdicts, rewards))
    metrics = aggregate(per_problem)
    if reward_weights:
        n = metrics["num_completions"]
        metrics["reward"] = reward_sums.pop("total") / n
        metrics.update({f"reward/{name}": total / n for name, total in reward_sums.items()})
    settings = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "num_samples": num_samples,
                "temperature": temperature, "seed": seed, "engine": choose_engine(model, engine)}
    return EvalResult(metrics, records, per_problem, settings, time.monotonic() - started)


def load_eval_examples(recipe: Any, tokenizer: Any, *, source: str | None = None, split: str | None = None,
                       limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` problems of a split (default: the recipe's eval split), as prompts for the recipe."""
    from lowmem_grpo.data import build_examples, load_rows

    d = recipe.data
    rows = load_rows(source or d.source, split or d.eval_split, d.hub_name, d.hub_config)
    if limit is not None:
        if limit < 1:
            raise BadInputError(f"limit {limit} must be at least 1", fix="use a positive number of problems")
        rows = rows[:limit]
    return build_examples(rows, tokenizer, d.system_prompt, d.prefill, d.max_prompt_length, d.long_prompts)


def make_eval_callback(recipe: Any, tokenizer: Any, run_dir: str | Path) -> Any:
    """A TrainerCallback evaluating on the held-out split every train.eval_every steps (imports transformers).

    Greedy, on the first train.eval_limit problems of data.eval_split, with the recipe's prompts and
    max_completion_length; writes `eval/<metric>` lines (stage "eval") into metrics.jsonl.
    """
    from transformers import TrainerCallback

    from lowmem_grpo import telemetry
    from lowmem_grpo.recipe import resolved_rewards

    t = recipe.train
    examples = load_eval_examples(recipe, tokenizer, limit=t.eval_limit)  # bad data fails before training
    metrics_path = Path(run_dir) / telemetry.METRICS_FILE
    weights = resolved_rewards(recipe)

    class PeriodicEvalCallback(TrainerCallback):
        """Greedy held-out evaluation every `every` optimizer steps."""

        every = t.eval_every

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
            if not self.every or state.global_step % self.every or not state.is_world_process_zero:
                return
            result = run_eval(model, tokenizer, examples, reward_weights=weights,
                              max_new_tokens=t.max_completion_length, batch_size=t.per_device_train_batch_size,
                              seed=t.seed, progress=False, engine="transformers")
            record = {"stage": "eval", "step": state.global_step,
                      **{f"eval/{k}": v for k, v in result.metrics.items()}, "eval/seconds": result.seconds}
            telemetry.append_jsonl(metrics_path, record)
            m = result.metrics
            log.info("eval step %d: strict %.3f | lenient %.3f | strict_format %.3f | soft_format %.3f | "
                     "%d problems in %.0f s", state.global_step, m["strict_accuracy"], m["lenient_accuracy"],
                     m["strict_format_rate"], m["soft_format_rate"], m["num_problems"], result.seconds)

    return PeriodicEvalCallback()
