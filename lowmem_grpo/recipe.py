"""The typed recipe: nested dataclasses with one docstring per field, and the rewards it names.

Files, overrides and YAML live in `recipe_io`, the rules that reject a bad recipe in `recipe_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


DEFAULT_SYSTEM_PROMPT = (
    "Respond in the following format:\n"
    "<reasoning>\n...\n</reasoning>\n"
    "<answer>\n...\n</answer>"
)

AUTO = "auto"

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# GRPOConfig fields the recipe owns elsewhere; setting them under `train` would be silently ignored.
MANAGED_TRAINER_FIELDS = {
    "output_dir": "output.dir",
    "reward_weights": "rewards.<name>",
    "max_prompt_length": "data.max_prompt_length",
    "warmup_steps": "train.warmup_ratio",
    "use_cpu": "(chosen from the device)",
}


@dataclass
class ModelConfig:
    """Which model to load and how."""

    name: str = "Qwen/Qwen2.5-1.5B-Instruct"
    """Hub id, local folder, or `embedded:smollm2-135m-instruct` (the registry-shipped CPU default)."""
    backend: Literal["auto", "unsloth", "hf"] = "auto"
    """auto: Unsloth when CUDA and unsloth are present, else plain transformers + PEFT."""
    load_in_4bit: bool = True
    """Quantize base weights to 4-bit nf4 (bitsandbytes); ignored by `hf` on CPU."""
    max_seq_length: int = 1024
    """Longest prompt + completion the model is prepared for."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Compute dtype; auto = bf16 on GPUs >= sm80 and CPUs with native bf16, fp16 on older GPUs, else fp32."""
    fast_inference: Literal[True, False, "auto"] | None = "auto"
    """Generate with vLLM through Unsloth (backend unsloth, CUDA; the `vllm` extra). auto: on when such a vLLM is
    installed, the run is one unsloth process on CUDA and the memory plan fits vLLM's pool (runtime.
    choose_fast_inference); None is off."""
    gpu_memory_utilization: float = 0.6
    """Share of GPU memory vLLM reserves with fast_inference (of free memory via Unsloth, of total in `eval`)."""
    trust_remote_code: bool = False
    """Allow model code from the hub (needed by a few architectures)."""


@dataclass
class LoraConfig:
    """The LoRA adapter that GRPO trains."""

    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input; 0 lets Unsloth use its fast path."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Module names to adapt."""
    max_lora_rank: int | None = None
    """Largest rank vLLM reserves for (Unsloth fast_inference); None = r."""
    init_adapter: str | None = None
    """Start from this LoRA adapter folder (same base, rank, alpha, modules) instead of a fresh one."""


@dataclass
class GeneratedDataConfig:
    """Procedurally generated GSM8K-style word problems (data.source=generated; lowmem_grpo.data.generated)."""

    task: str = "arithmetic"
    """Task family of the generated problems."""
    levels: str = "1-3"
    """Levels drawn uniformly: "2", "1-3" or "1,4"; 1-3 = steps, 4 = big numbers, 5 = a distractor (see LEVELS)."""
    grpo_levels: str | None = None
    """The levels GRPO draws from, some of `levels`, repeats weigh more ("1,2,2,2"); None = all of them."""
    operations: str = "add,sub,mul,div"
    """The operations a step may take, comma-separated: some of add, sub, mul, div."""
    train_size: int = 2000
    """Problems in the generated train split."""
    test_size: int = 500
    """Problems in the generated test split (disjoint from train by construction)."""
    seed: int = 0
    """Seed of the generator: the same seed gives the same problems."""
    eval_stories: Literal["all", "seen", "heldout"] = "all"
    """Wording of the test problems: seen (the train split's), heldout (never in train), or all (half each)."""


@dataclass
class DataConfig:
    """Where the GSM8K problems come from and how prompts are built."""

    source: str = "hub"
    """hub (openai/gsm8k), embedded (shipped sample), generated (data.generated), or a .jsonl/.json/.parquet/.csv."""
    hub_name: str = "openai/gsm8k"
    """Dataset id used when source is hub."""
    hub_config: str = "main"
    """Dataset config used when source is hub."""
    train_split: str = "train"
    """Split trained on."""
    eval_split: str = "test"
    """Held-out split for evaluation."""
    limit: int | None = None
    """Use at most this many training problems (after shuffling); None = all."""
    shuffle_seed: int = 42
    """Seed of the shuffle before `limit` is applied."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System message asking for the reasoning/answer format."""
    prefill: str = ""
    """Text that starts every assistant turn (e.g. "<reasoning>\\n"); rewards score prefill + completion."""
    max_prompt_length: int = 256
    """Longest prompt in tokens, measured with the model's chat template."""
    long_prompts: Literal["filter", "truncate"] = "filter"
    """What to do with longer prompts: drop them, or cut the question from the left."""
    generated: GeneratedDataConfig = field(default_factory=GeneratedDataConfig)
    """The generated problems, when source is generated."""
    calculator: bool = False
    """Sampling completes `<<EXPR=` with the calculator's result, kept out of the loss (GSM8K-format data only)."""


@dataclass
class StageEvalConfig:
    """The held-out evaluation after each stage: what priming and GRPO each bought (lowmem_grpo.evaluation.stages)."""

    problems: int = 0
    """Greedy eval of each stage on the first N problems of data.eval_split, with 95% CIs (0 = off)."""
    stages: list[str] = field(default_factory=lambda: ["base", "start", "primed", "trained"])
    """Which stages are measured (start: the lora.init_adapter, when given)."""
    samples: int = 4
    """Also sample this many completions per problem at train.temperature: mean@k, pass@k (0 = greedy only)."""


@dataclass
class EvalConfig:
    """Held-out evaluation during a run: periodic (every N steps) and per stage."""

    every: int = 0
    """Greedy evaluation on data.eval_split every N steps, logged as eval/* in metrics.jsonl (0 = never)."""
    problems: int = 50
    """Problems of data.eval_split the periodic evaluation uses (the first N)."""
    samples: int = 0
    """Also sample k completions per problem: eval/mean@k, eval/pass@k, eval_steps.jsonl (0 = greedy only)."""
    batch_size: int | None = None
    """Sequences an evaluation decodes at once; None = the memory plan's on a GPU (see `plan`), else 128."""
    stage: StageEvalConfig = field(default_factory=StageEvalConfig)
    """The evaluation after each stage (base, start, primed, trained)."""


@dataclass
class PreflightConfig:
    """The reward preflight before GRPO: would the rewards give it a signal? (lowmem_grpo.train.preflight)."""

    enabled: bool = True
    """Sample GRPO groups before training; refuse to start when the goal reward or total varies in (almost) none."""
    prompts: int = 16
    """Prompt groups the preflight samples from problems priming did not see (no refusal on fewer than 16)."""
    allow_no_signal: bool = False
    """Train even when the preflight finds no signal (GRPO would learn nothing, or only the format)."""


@dataclass
class MemoryConfig:
    """Fitting the run to the GPU's memory, before it starts and after an out-of-memory error."""

    auto_fit: bool | None = None
    """Fit the settings not given on the command line to the GPU's free memory; None = on CUDA, false = never."""
    oom_retries: int = 2
    """CUDA out of memory: lower the memory settings, continue from the last complete checkpoint; at most N times."""


@dataclass
class CpuConfig:
    """lowmem_grpo's speed paths for the hf backend on a CPU; lowmem_grpo.runtime decides which run."""

    fast: bool = True
    """CPU speed paths (shared-prompt engine, merged LoRA, own attention); false runs TRL, PEFT, transformers as is."""


@dataclass
class TrainConfig:
    """GRPO settings with the run's sections; any other GRPOConfig field added here is passed through."""

    max_steps: int = 250
    """Optimizer steps."""
    num_generations: int = 8
    """Completions sampled per prompt (the GRPO group)."""
    per_device_train_batch_size: int = 8
    """Completions per device per forward/backward micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    steps_per_generation: int | None = None
    """Micro-batches generated at once; None = gradient_accumulation_steps."""
    max_completion_length: int = 256
    """Longest completion in tokens; it must fit the worked solutions (train.max_truncated_targets)."""
    max_truncated_targets: float = 0.02
    """Largest share of rendered worked solutions max_completion_length may cut (1 = never check)."""
    mask_truncated_completions: bool = True
    """Keep completions cut at max_completion_length out of the loss (still scored; DAPO's overlong filtering)."""
    temperature: float = 1.0
    """Sampling temperature during generation."""
    learning_rate: float = 5e-6
    """Peak learning rate."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    warmup_ratio: float = 0.1
    """Share of steps spent warming up (TRL 1.x dropped the field; mapped to its ratio form)."""
    lr_scheduler_type: str = "cosine"
    """Learning-rate schedule."""
    max_grad_norm: float = 0.1
    """Gradient clipping norm."""
    optim: str = "auto"
    """auto = paged_adamw_8bit on CUDA, adamw_torch on CPU; or any transformers optimizer name."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto = bf16 where supported, fp16 on older GPUs, fp32 on CPU."""
    beta: float = 0.0
    """KL coefficient; > 0 keeps a reference model (more memory)."""
    logging_steps: int = 1
    """Log every this many steps."""
    save_steps: int = 50
    """Checkpoint every this many steps."""
    save_total_limit: int = 2
    """Checkpoints kept."""
    seed: int = 42
    """Seed for sampling and initialisation."""
    report_to: str = "none"
    """none, tensorboard, wandb or trackio."""
    completions_every: int = 10
    """Write sampled completions with their per-reward scores to completions.jsonl every N steps (0 = never)."""
    vllm_sampling: bool = False
    """Sample GRPO's completions with a vLLM engine on the base model and the live adapter (docs/vllm.md)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: periodic and per stage."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """The reward preflight before GRPO."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Auto-fit and out-of-memory retries."""
    cpu: CpuConfig = field(default_factory=CpuConfig)
    """The CPU speed paths."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other GRPOConfig fields, written flat in the train section; checked against TRL's fields."""

    def steps_per_generation_resolved(self) -> int:
        """The micro-batches TRL generates at once."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    def generation_batch_size(self, num_processes: int = 1) -> int:
        """Completions generated per generation round, as TRL computes it."""
        explicit = self.extra.get("generation_batch_size")
        if explicit:
            return int(explicit)
        return self.per_device_train_batch_size * num_processes * self.steps_per_generation_resolved()


@dataclass
class PrimeConfig:
    """The supervised format warm start of the same LoRA adapter before GRPO (lowmem_grpo.train.prime)."""

    enabled: bool = False
    """Prime the adapter on worked solutions rendered in the target format, then run GRPO on it."""
    max_steps: int = 30
    """Optimizer steps of priming (the examples are cycled when there are fewer)."""
    num_examples: int | None = None
    """Prime on the first N training problems (after the shuffle); None = all of them."""
    learning_rate: float = 2e-4
    """Peak learning rate of priming."""
    per_device_train_batch_size: int = 8
    """Rendered solutions per device per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    lr_scheduler_type: str = "constant"
    """Learning-rate schedule of priming."""
    warmup_ratio: float = 0.0
    """Share of priming steps spent warming up."""


@dataclass
class OutputConfig:
    """Where the run directory goes."""

    dir: str | None = None
    """Run directory; None = <root>/<recipe name>-<timestamp>."""
    root: str = "runs"
    """Parent of generated run directories."""


@dataclass
class Recipe:
    """One model x task training recipe."""

    name: str = "recipe"
    """Short name, used for the run directory."""
    task: str = "gsm8k"
    """Task the reward set and data belong to."""
    description: str = ""
    """One line shown by `lowmem-grpo recipes`."""
    gpu_memory_gb: int | None = None
    """GPU memory the recipe is tuned for (8, 12, 16, 24); None = CPU."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and backend."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data and prompts."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward name (or module:function) -> weight; empty = the task's default set."""
    goal_reward: str | None = None
    """The reward that defines success (score >= 0.5 passes); None = the task's, when the rewards include it."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """GRPO trainer settings."""
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    """Supervised format priming before GRPO."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Run directory."""


def resolved_rewards(recipe: Recipe) -> dict[str, float]:
    """Reward name -> weight, the task's default set when the recipe names none."""
    from lowmem_grpo.rewards import GSM8K_DEFAULT_WEIGHTS

    return dict(recipe.rewards) if recipe.rewards else dict(GSM8K_DEFAULT_WEIGHTS)


def goal_reward(recipe: Recipe) -> str | None:
    """The goal reward, a key of `resolved_rewards`: goal_reward, else the task's when present, else None."""
    if recipe.goal_reward is not None:
        return recipe.goal_reward
    default = {"gsm8k": "correctness"}.get(recipe.task)  # the task's goal reward
    return default if default in resolved_rewards(recipe) else None


def goal_reward_name(recipe: Recipe) -> str | None:
    """The goal reward's function name: the one TRL logs it under (rewards/<name>/mean) and scores are keyed by."""
    from lowmem_grpo.rewards import get_reward

    key = goal_reward(recipe)
    return None if key is None else get_reward(key).__name__
