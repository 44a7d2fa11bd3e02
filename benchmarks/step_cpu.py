"""Like-for-like CPU benchmark of a GRPO step: lowmem_grpo's train() before and after its CPU switches, and a plain
TRL + PEFT script, all three built from the CPU default recipe (recipes/smollm2_135m_arith_cpu.py).

    OMP_NUM_THREADS=2 python benchmarks/step_cpu.py --models smollm2 --steps 6 --repeats 2
    OMP_NUM_THREADS=2 LOWMEM_GRPO_CPU_DTYPE=float32 python benchmarks/step_cpu.py --models smollm2 --steps 6 --repeats 2
    OMP_NUM_THREADS=1 python benchmarks/step_cpu.py --models tiny --dtypes float32,bfloat16 --steps 6 --repeats 3

The first is the CPU default's own shape on 2 cores (model.dtype=auto: bfloat16 on a CPU with native bfloat16); the
second the same in float32 (the AVX2 CPU kind's dtype); the third the 2-layer test model, for the script itself.
tests/test_step_cpu_check.py runs each of these commands with --check-only (parsed from this docstring; the
real model for the first, the tiny one for the others).

The spec is the recipe itself (load_recipe), not a copy: its data (generated problems, the recipe's levels and
seed), system prompt, prefill and prompt-length rule, LoRA, GRPOConfig values (num_generations, batch, accumulation,
max_completion_length, temperature, beta, scale_rewards, mask_truncated_completions, ...) and rewards. The benchmark
changes only: the model (tiny, or the embedded SmolLM2), model.dtype when --dtypes names one, train.max_steps, and
no preflight, stage or periodic evaluation (--set KEY=VALUE ... changes the recipe for all three sides: another
shape). The CPU default's GRPO starts from its primed adapter and anchors its KL to it: with --start primed (the
default) the recipe's priming runs once, through train(), and all three sides start from that adapter (plain:
PeftModel.from_pretrained, trainable; TRL copies it as the reference, as it does for ours). The plain side derives
its GRPOConfig from the recipe's train section generically (every TrainConfig field that is a GRPOConfig field,
train.extra, and the few the package resolves: plain_grpo_values), builds its rows with the package's data
functions, and uses the CPU-safe GRPOTrainer (TRL 1.15's log-prob pass is a Triton kernel with no CPU driver) with
lowmem_grpo's CPU changes off (PLAIN_TRAINER: full-row log-prob passes, PEFT's unmerged layers and head copies while
sampling), so it is what a user writes by hand.

The three sides, each in its own process:
  plain   the plain TRL + PEFT script (the default glibc allocator)
  before  our train() with the newest switch off (--before; default train.cpu_attention=false: transformers' sdpa
          attention, PyTorch's flash kernel for CPU, in sampling and the log-prob passes; --before
          train.cpu_attention=false train.sampling_engine=false train.merged_sampling=false train.shared_prompt=false
          turns off all of our CPU sampling and log-prob changes that have a switch)
  after   our train() as shipped (the recipe's defaults)
Our train() pins glibc's mmap threshold at lowmem_grpo.rundir.rss.MMAP_THRESHOLD (8 MiB) for the whole process; the
"plain pinned" run is the plain script with MALLOC_MMAP_THRESHOLD_ at the same value: the allocator taken out.

Before any timing each worker records, from inside its trainer, a fingerprint: the GRPOConfig (minus output
paths), the LoRA config, the parameter dtypes, hashes of the rows in order and of the initial LoRA weights, the
reward names and weights, the trainer and optimizer classes, the torch thread count. `before` and `after` are each
compared with `plain`; the script prints them and stops with exit 1, naming the keys, when they differ. --check-only
stops there (it primes one step only): the completion-budget check (ours runs it in train()) and the fingerprints.
Which of our switches were live on each side is printed too (layer: not compared).

Columns, per side (medians over --repeats runs a side, run in rotating order):
  s/step      median wall time between consecutive step ends; cpu s/step the same in process CPU seconds;
              TRL step_time TRL's own (generation + loss + backward only)
  start-up    process start to the first step's begin (wall and CPU): imports, data, model, priming's adapter load
  teardown    last step end to the end of train() (adapter, report; the plain script saves its adapter)
  faults      minor page faults and kernel CPU seconds per step (the allocator's share of a step)
  RSS GiB     the worker's peak RSS (ru_maxrss)
rows plain, plain pinned (one run), before, after; then the ratios after/before (what the switches bought),
after/plain and before/plain (ours vs plain TRL + PEFT), after/plain pinned (the same with the allocator taken
out), the ratio of the minima over the runs (load on shared cores only ever adds time), the completions per step
(mean length, reward; the sides share seeds and prompts, so the same draws show as the same numbers; TRL's
generation and the engine sample by different methods from the same seed, so before's and after's completions
differ token for token: compare their mean lengths), then the phase table: mean seconds of each time/<phase>
key (lowmem_grpo.train.callbacks.PhaseTimer, attached to the plain trainer too; steps after the first) per side,
after/before, after/plain, and each phase's share of after's step; our layer's own per-step cost; the phase
timer's own cost; the load average. Shared cores: read the CPU columns and the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package of this checkout, also when it is not installed
from lowmem_grpo.rundir.rss import MMAP_THRESHOLD  # noqa: E402 - standard library only

RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")  # the CPU default: the spec
SIDES = ("plain", "before", "after")
OURS = ("before", "after")
BEFORE = ["train.cpu_attention=false"]  # the "before" side's switches (--before replaces them)
BENCH_OVERRIDES = ["train.preflight=false", "train.stage_eval=0", "train.eval_every=0"]  # no evaluation in a step
PLAIN_TRAINER = {"lowmem_shared_prompt": False, "lowmem_merged_sampling": False, "lowmem_cpu_attention": False}
IGNORED = {"output_dir", "logging_dir", "run_name"}  # per-run paths, not settings
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def documented_commands(doc: str | None = None) -> list[tuple[dict[str, str], list[str]]]:
    """The commands this docstring gives, as (environment settings, arguments after the script)."""
    out = []
    for line in (doc or __doc__).splitlines():
        if "python benchmarks/step_cpu.py" not in line:
            continue
        words = shlex.split(line)
        at = words.index("benchmarks/step_cpu.py")
        env = dict(w.split("=", 1) for w in words[:at] if "=" in w)
        out.append((env, words[at + 1:]))
    return out


# ---- the comparison (pure: tested in tests/test_step_cpu_check.py) ------------------------------------------

def compare(ours: dict[str, Any], plain: dict[str, Any]) -> list[str]:
    """Every fingerprint key whose value differs, as 'section.key: lowmem=... plain=...' (nested one level)."""
    diffs = []
    for key in sorted(ours.keys() | plain.keys()):
        a, b = ours.get(key), plain.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key}.{k}: lowmem={a.get(k)!r} plain={b.get(k)!r}" for k in sorted(a.keys() | b.keys())
                      if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{key}: lowmem={a!r} plain={b!r}")
    return diffs


def check_same(ours: dict[str, Any], plain: dict[str, Any], label: str, show: bool = True) -> None:
    """Print both configurations (unless `show` is off and they agree); exit 1 naming the differing keys when they
    are not the same. `label` names the pair (e.g. "tiny float32 after")."""
    diffs = compare(ours, plain)
    if show or diffs:
        sys.stdout.write(f"config {label} lowmem: {json.dumps(ours, sort_keys=True)}\n")
        sys.stdout.write(f"config {label} plain:  {json.dumps(plain, sort_keys=True)}\n")
    if diffs:
        sys.stderr.write(f"\nNOT LIKE FOR LIKE ({label}): the two runners differ in {len(diffs)} key(s):\n  "
                         + "\n  ".join(diffs) + "\n")
        raise SystemExit(f"configurations differ ({label}): {', '.join(d.split(':')[0] for d in diffs)}")
    sys.stdout.write(f"config {label}: identical on both sides\n")


# ---- inside a worker: the fingerprint and the step marks -------------------------------------------------------

def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def fingerprint(trainer: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """What the trainer is about to train with, read from the trainer itself."""
    import torch

    peft = model.peft_config["default"].to_dict()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lora_bytes = b"".join(n.encode() + p.detach().float().cpu().numpy().tobytes() for n, p in trainable)
    data = trainer.train_dataset
    inner = getattr(optimizer, "optimizer", optimizer)
    return _jsonable({
        "trainer_class": type(trainer).__name__,
        "grpo": {k: v for k, v in trainer.args.to_dict().items() if k not in IGNORED},
        "lora": {k: v for k, v in peft.items() if k not in {"base_model_name_or_path", "revision"}},
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable_params": sum(p.numel() for _, p in trainable),
        "prompts_sha": _sha("\x1e".join(data["prompt"]).encode()),
        "rows_sha": _sha(json.dumps(data.to_list(), sort_keys=True).encode()),
        "columns": sorted(data.column_names),
        "lora_init_sha": _sha(lora_bytes),
        "rewards": [[n, float(w)] for n, w in zip(trainer.reward_func_names, trainer.reward_weights.tolist())],
        "optimizer": {"class": type(inner).__name__,
                      **{k: v for k, v in inner.param_groups[0].items() if k not in {"params", "initial_lr"}}},
        "torch_threads": torch.get_num_threads(),
    })


def layer(trainer: Any) -> dict[str, Any]:
    """Which of lowmem_grpo's CPU changes are live in this trainer (reported, not compared: they are the subject)."""
    shared = trainer.shared_prompt_status()[0] if hasattr(trainer, "shared_prompt_status") else False
    return {"sampling_engine": getattr(trainer, "rollout_func", None) is not None, "shared_prompt": shared,
            "merged_sampling": bool(getattr(trainer, "lowmem_merged_sampling", False)),
            "cpu_attention": bool(getattr(trainer, "lowmem_cpu_attention", False))}


def _process_start() -> float:
    """This process's start, in time.time() seconds (from /proc, so it counts the interpreter's own start-up)."""
    with open("/proc/self/stat") as handle:
        ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as handle:
        boot = next(int(line.split()[1]) for line in handle if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _calling_trainer() -> Any:
    """The Trainer whose training loop called this callback (callback events carry the model, not the trainer)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "callback_handler") and hasattr(candidate, "args"):
            return candidate
        frame = frame.f_back
    raise RuntimeError("no Trainer up the stack")


class Probe:
    """A trainer callback (duck-typed, so that this script imports no transformers outside the workers): the
    fingerprint at train begin, wall and CPU marks at each step's begin and end, and the logged records."""

    def __init__(self, check_only: bool) -> None:
        self.check_only = check_only
        self.fingerprint: dict[str, Any] = {}
        self.layer: dict[str, Any] = {}
        self.begins: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float, int, float]] = []
        self.logs: list[dict[str, Any]] = []
        self.timer: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # every other callback event: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        trainer = _calling_trainer()
        self.fingerprint = fingerprint(trainer, model, optimizer)
        self.layer = layer(trainer)
        self.timer = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "PhaseTimer"), None)
        if self.check_only:
            sys.stdout.write("FINGERPRINT " + json.dumps(self.fingerprint) + "\n")
            sys.stdout.write("LAYER " + json.dumps(self.layer) + "\n")
            sys.stdout.flush()
            os._exit(0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begins.append((time.time(), time.process_time()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)  # page faults and kernel time: the allocator's share
        self.ends.append((time.time(), time.process_time(), usage.ru_minflt, usage.ru_stime))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs:
            self.logs.append(dict(logs))


# ---- the three sides ---------------------------------------------------------------------------------------------

def side_overrides(spec: dict[str, Any], side: str, path: str, out: Path) -> list[str]:
    """What the benchmark changes in the recipe for `side` (prime, plain, before, after)."""
    overrides = [f"model.name={path}", f"output.dir={out}", f"train.max_steps={spec['steps']}", *BENCH_OVERRIDES]
    overrides += [f"model.dtype={spec['dtype']}"] if spec["dtype"] != "auto" else []
    overrides += spec.get("set", [])
    if side == "prime":
        return overrides + ["prime.enabled=true"] + ([f"prime.max_steps={spec['prime_steps']}"]
                                                     if spec.get("prime_steps") else [])
    overrides += ["prime.enabled=false"]
    overrides += [f"lora.init_adapter={spec['start_adapter']}"] if spec.get("start_adapter") else []
    return overrides + (spec["before"] if side == "before" else [])


def side_recipe(spec: dict[str, Any], side: str, path: str, out: Path) -> Any:
    from lowmem_grpo.recipe_io import load_recipe

    return load_recipe(RECIPE, side_overrides(spec, side, path, out))


def run_lowmem(recipe: Any, probe: Probe) -> None:
    from lowmem_grpo.train.pipeline import train

    train(recipe, callbacks=[probe])


def plain_grpo_values(recipe: Any) -> dict[str, Any]:
    """The GRPOConfig values a plain script gets from the recipe: every train field that is a GRPOConfig field, the
    extra fields, and those lowmem_grpo resolves (warmup_ratio is TRL 1.x's float warmup_steps; optim auto is
    adamw_torch on CPU; precision auto is neither bf16 nor fp16 on CPU; lowmem_grpo keeps its own checkpoints)."""
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    t = recipe.train
    values = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name in fields}
    values.update(t.extra)
    values.update(warmup_steps=t.warmup_ratio, optim="adamw_torch" if t.optim == "auto" else t.optim,
                  report_to=[] if t.report_to == "none" else [t.report_to], save_total_limit=None,
                  bf16=t.precision == "bf16", fp16=t.precision == "fp16")
    return values


def run_plain(recipe: Any, out: Path, probe: Probe) -> None:
    """What a user writes by hand with TRL + PEFT, from the same recipe."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig

    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe import resolved_rewards
    from lowmem_grpo.rewards import get_reward
    from lowmem_grpo.runtime import resolve
    from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer

    path, lora = recipe.model.name, recipe.lora
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = resolve(recipe, Launch(), CudaFacts(torch_cuda=None, available=False)).dtype  # what train() asks on CPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    set_seed(recipe.train.seed)  # LoRA A comes from the global RNG, which torch seeds randomly per process
    if lora.init_adapter:
        model = PeftModel.from_pretrained(model, lora.init_adapter, is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 bias="none", task_type="CAUSAL_LM",
                                                 target_modules=lora.target_modules))
    weights = resolved_rewards(recipe)
    config = GRPOConfig(output_dir=str(out), save_strategy="steps", use_cpu=True, disable_tqdm=True,
                        reward_weights=list(weights.values()), **plain_grpo_values(recipe))
    rows = recipe_examples(load_train_rows(recipe.data), tokenizer, recipe.data)
    trainer = CpuSafeGRPOTrainer(model=model, reward_funcs=[get_reward(n) for n in weights], args=config,
                                 train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                 callbacks=[probe])
    for name, value in PLAIN_TRAINER.items():  # only the Triton log-prob kernel replaced
        setattr(trainer, name, value)
    from lowmem_grpo.train.callbacks import PhaseTimer

    PhaseTimer.attach(trainer)  # the same instrumentation as ours
    trainer.train()
    trainer.save_model(str(out / "adapter"))


# ---- the phase timer's own cost --------------------------------------------------------------------------------

class _FakeAccelerator:
    """Stands in for a trainer's accelerator in the timer microbenchmark."""

    device = SimpleNamespace(type="cpu")

    def backward(self, loss: Any) -> None:
        return None


class _FakeTrainer:
    """A trainer whose timed methods do nothing: what is left is the timer's own cost."""

    def __init__(self) -> None:
        from collections import defaultdict

        self.accelerator = _FakeAccelerator()
        self._metrics = {"train": defaultdict(list)}
        self.callback_handler = SimpleNamespace(callbacks=[])

    def _generate_and_score_completions(self, batch: Any) -> Any:
        self._generate(batch)
        return self._calculate_rewards(batch)

    def _generate(self, batch: Any) -> Any:
        return None, batch

    def _calculate_rewards(self, batch: Any) -> None:
        return None

    def compute_loss(self, batch: Any) -> None:
        return None


class _NoTimer:
    """The timer's four step events, doing nothing: the baseline of the microbenchmark."""

    def on_step_begin(self, *args: Any) -> None:
        return None

    on_pre_optimizer_step = on_optimizer_step = on_step_end = on_step_begin


def _fake_steps(trainer: _FakeTrainer, timer: Any, steps: int) -> float:
    """Seconds per simulated step: the five timed calls of a step and the timer's four events."""
    batch, state = [[1] * 64] * 8, SimpleNamespace(global_step=0, max_steps=10**9)
    events = timer or _NoTimer()
    started = time.perf_counter()
    for _ in range(steps):
        events.on_step_begin(None, state, None)
        trainer._generate_and_score_completions(batch)
        trainer.compute_loss(batch)
        trainer.accelerator.backward(None)
        events.on_pre_optimizer_step(None, state, None)
        events.on_optimizer_step(None, state, None)
        events.on_step_end(None, state, None)
        trainer._metrics["train"].clear()  # as GRPOTrainer.log does at each log
    return (time.perf_counter() - started) / steps


def timer_cost_s() -> float | None:
    """The phase timer's own seconds per step (best of 5 runs of 2000 simulated steps, minus the bare calls)."""
    try:
        from lowmem_grpo.train.callbacks import PhaseTimer
    except ImportError:
        return None
    bare, timed = _FakeTrainer(), _FakeTrainer()
    timer = PhaseTimer.attach(timed)
    return min(_fake_steps(timed, timer, 2000) for _ in range(5)) - min(_fake_steps(bare, None, 2000) for _ in range(5))


# ---- a worker process ---------------------------------------------------------------------------------------------

def model_path(name: str, work: Path) -> str:
    """The tiny test model (built once in the work folder) or the embedded SmolLM2 (converted once)."""
    if name == "tiny":
        target = work / "tiny"
        if not (target / "config.json").exists():
            sys.path.insert(0, str(REPO / "tests"))
            from tiny import build_tiny_model

            build_tiny_model(target)
        return str(target)
    if name != "smollm2":
        raise SystemExit(f"--models: {name!r} is neither tiny nor smollm2")
    from lowmem_grpo.backends.embedded import embedded_model_dir

    return str(embedded_model_dir("embedded:smollm2-135m-instruct"))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(probe: Probe, started: tuple[float, float], done: tuple[float, float]) -> dict[str, Any]:
    """Start-up, s/step (wall and CPU, between step ends), teardown and the logged phase records of one run."""
    ends = probe.ends
    walls = [b[0] - a[0] for a, b in zip(ends, ends[1:])] or [ends[0][0] - probe.begins[0][0]]
    cpus = [b[1] - a[1] for a, b in zip(ends, ends[1:])] or [ends[0][1] - probe.begins[0][1]]
    faults = [b[2] - a[2] for a, b in zip(ends, ends[1:])]
    kernel = [b[3] - a[3] for a, b in zip(ends, ends[1:])]
    steps = [r for r in probe.logs if "step_time" in r]
    return {
        "s_per_step": _median(walls), "cpu_per_step": _median(cpus), "steps": len(ends),
        "minflt_per_step": _median(faults), "sys_per_step": _median(kernel),
        "trl_step_time": _median([r["step_time"] for r in steps[1:]] or [r["step_time"] for r in steps]),
        "startup_wall": probe.begins[0][0] - started[0], "startup_cpu": probe.begins[0][1],
        "teardown_wall": done[0] - ends[-1][0], "teardown_cpu": done[1] - ends[-1][1],
        "phase_records": [{k: v for k, v in r.items() if k.startswith("time/") or k == "tokens_per_s"}
                          for r in steps[1:] or steps],
        # the same draws show as the same lengths and rewards, step by step
        "draws": [[r.get("completions/mean_length"), r.get("reward")] for r in steps],
    }


def worker(side: str, spec_path: Path, work: Path, check_only: bool) -> None:
    spec = json.loads(spec_path.read_text())
    started = (_process_start(), 0.0)  # CPU time counts from the process start too
    path = model_path(spec["model"], work)
    out = Path(tempfile.mkdtemp(prefix=f"{spec['model']}-{spec['dtype']}-{side}-", dir=work))
    out.rmdir()
    recipe = side_recipe(spec, side, path, out)
    probe = Probe(check_only or side == "prime")  # priming: stop where GRPO would begin
    if side == "plain":
        run_plain(recipe, out, probe)
    else:
        run_lowmem(recipe, probe)
    done = (time.time(), time.process_time())
    result = summarize(probe, started, done)
    result["timer_cost_s"] = timer_cost_s() if probe.timer is not None else None
    sys.stdout.write("FINGERPRINT " + json.dumps(probe.fingerprint) + "\n")
    sys.stdout.write("LAYER " + json.dumps(probe.layer) + "\n")
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


# ---- the parent: run, check, print ----------------------------------------------------------------------------

def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _run_worker(side: str, spec_path: Path, work: Path, env: dict[str, str], check_only: bool = False
                ) -> tuple[int, str, str, float]:
    """One worker process: exit code, stdout, the tail of stderr, and its own peak RSS in GiB (wait4's rusage)."""
    cmd = [sys.executable, __file__, "--worker", side, str(spec_path), "--work", str(work)]
    cmd += ["--check-only"] if check_only else []
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it: this child's own peak, not a running maximum
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        errors.seek(0)
        stderr = errors.read()[-3000:]
    return proc.returncode, stdout, stderr, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def run_side(side: str, spec_path: Path, work: Path, env: dict[str, str], check_only: bool = False) -> dict[str, Any]:
    """One worker's fingerprint, live switches, results, load average and peak RSS (GiB)."""
    load_before = os.getloadavg()[0]
    code, stdout, stderr, rss = _run_worker(side, spec_path, work, env, check_only)
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines()
             if ln.startswith(("RESULT ", "FINGERPRINT ", "LAYER "))}
    if code != 0 or "FINGERPRINT" not in lines or ("RESULT" not in lines and not check_only):
        raise SystemExit(f"{side} worker failed (exit {code}):\n{stderr}\nrerun: {sys.executable} {__file__} "
                         f"--worker {side} {spec_path} --work {work}{' --check-only' if check_only else ''}")
    result = lines.get("RESULT", {})
    result.update(fingerprint=lines["FINGERPRINT"], layer=lines.get("LAYER", {}),
                  load=f"{load_before:.1f}->{os.getloadavg()[0]:.1f}", peak_rss_gib=rss)
    return result


def prime_once(spec: dict[str, Any], spec_path: Path, work: Path, env: dict[str, str]) -> str:
    """The recipe's priming, through train(), once: the adapter every side starts from."""
    run_side("prime", spec_path, work, env, check_only=True)
    found = sorted(work.glob(f"{spec['model']}-{spec['dtype']}-prime-*/primed_adapter"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"priming left no primed_adapter in {work}")
    return str(found[-1])


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


RATIOS = (("after", "before"), ("after", "plain"), ("before", "plain"), ("after", "plain pinned"))
COLUMNS = [("s/step", "s_per_step", ".3f"), ("cpu s/step", "cpu_per_step", ".3f"),
           ("TRL step_time", "trl_step_time", ".3f"),
           ("start-up s", "startup_wall", ".2f"), ("start-up cpu", "startup_cpu", ".2f"),
           ("teardown s", "teardown_wall", ".2f"), ("teardown cpu", "teardown_cpu", ".2f"),
           ("minor faults/step", "minflt_per_step", ".0f"), ("sys s/step", "sys_per_step", ".3f"),
           ("RSS GiB", "peak_rss_gib", ".3f")]


def print_results(label: str, results: dict[str, dict[str, Any]]) -> None:
    """The per-side table, the ratios, the draws and the phase breakdown."""
    rows = [s for s in ("plain", "plain pinned", "before", "after") if s in results]
    out = [f"\n## {label}", "| side | " + " | ".join(c[0] for c in COLUMNS) + " | 1-min load (before->after) |",
           "|---" * (len(COLUMNS) + 2) + "|"]
    for side in rows:
        r = results[side]
        out.append(f"| {side} | " + " | ".join(_fmt(r.get(k), f) for _, k, f in COLUMNS) + f" | {r['load']} |")
    for a, b in RATIOS:
        if a in results and b in results:
            out.append(f"| ratio {a}/{b} | " + " | ".join(_fmt(_ratio(results[a].get(k), results[b].get(k)), ".3f")
                                                      for _, k, _ in COLUMNS) + " | |")
    for side in rows:
        out.append(f"{side}: lowmem_grpo's switches live: {json.dumps(results[side].get('layer', {}), sort_keys=True)}")
    for key in ("cpu_per_step", "s_per_step"):
        per_run = {side: [r[key] for r in results[side]["runs"]] for side in SIDES}
        if len(per_run["plain"]) > 1:
            out.append(f"{key} per run: " + "; ".join(f"{s} {[round(v, 3) for v in per_run[s]]}" for s in SIDES)
                       + "; ratio of the minima after/before "
                       f"{min(per_run['after']) / min(per_run['before']):.3f}, after/plain "
                       f"{min(per_run['after']) / min(per_run['plain']):.3f}")
    out.append("completions (mean length, reward) per step:")
    out += [f"  {side}: {results[side]['draws']}" for side in SIDES]
    same = [f"{a}={b}" for a, b in (("before", "plain"), ("after", "plain"), ("after", "before"))
            if results[a]["draws"] == results[b]["draws"]]
    out.append(f"  the same draws: {', '.join(same) or 'no two sides'}")
    out += phase_lines(results)
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def phase_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Phase means side by side (steps after the first), the ratios, and the timer's own cost per step."""
    from lowmem_grpo.rundir.telemetry import PHASES, phase_means

    means = {side: phase_means(results[side]["phase_records"]) for side in SIDES}
    if not means["after"]:
        return ["(no phase timing logged)"]
    out = ["", "| phase | plain s | before s | after s | after/before | after/plain | after share |",
           "|---|---|---|---|---|---|---|"]
    for key in [f"time/{p}" for p in PHASES] + ["time/step", "time/sampling_share", "tokens_per_s"]:
        p, b, a = (means[s].get(key) for s in SIDES)
        is_seconds = key.startswith("time/") and key != "time/sampling_share"
        share = a / means["after"]["time/step"] if a is not None and is_seconds else None
        out.append(f"| {key} | {_fmt(p, '.4f')} | {_fmt(b, '.4f')} | {_fmt(a, '.4f')} | {_fmt(_ratio(a, b), '.3f')} "
                   f"| {_fmt(_ratio(a, p), '.3f')} | {_fmt(share, '.1%')} |")
    # our layer's per-step code (rewards guard and recorder, telemetry, callbacks) runs in these phases only
    ours_keys = ["time/rewards", "time/other", "time/checkpoint_telemetry"]
    if means["plain"]:
        extra = sum(means["after"].get(k, 0.0) - means["plain"].get(k, 0.0) for k in ours_keys)
        out.append(f"our layer's own per-step cost (after - plain in {', '.join(ours_keys)}): {extra * 1e3:+.2f} ms"
                   f" = {extra / means['plain']['time/step']:+.3%} of plain's step")
    cost, step = results["after"].get("timer_cost_s"), results["after"].get("s_per_step")
    if cost is not None and step:
        out.append(f"phase timer's own cost: {cost * 1e6:.1f} us per step = {cost / step:.4%} of a step")
    return out


NUMERIC = ("s_per_step", "cpu_per_step", "trl_step_time", "startup_wall", "startup_cpu", "teardown_wall",
           "teardown_cpu", "peak_rss_gib", "timer_cost_s", "minflt_per_step", "sys_per_step")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as one result: the median of each number, the phase records pooled, every run kept."""
    out = dict(runs[0])
    for key in NUMERIC:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if values else None
    out["phase_records"] = [rec for r in runs for rec in r["phase_records"]]
    out["runs"] = [{k: r.get(k) for k in NUMERIC + ("load",)} for r in runs]
    out["load"] = "; ".join(r["load"] for r in runs)
    return out


def check_sides(checks: dict[str, dict[str, Any]], label: str, show: bool = True) -> None:
    """Each of our sides against the plain one (exit 1 naming the keys when they differ)."""
    for side in OURS:
        check_same(checks[side]["fingerprint"], checks["plain"]["fingerprint"], f"{label} {side}",
                   show=show and side == "after")  # printed once (a differing pair always is)


def measure(spec: dict[str, Any], work: Path, pinned: bool, repeats: int, check_only: bool) -> None:
    """Prime once (--start primed), check the three sides' configurations, then run each `repeats` times in
    rotating order (and the plain side once more with the allocator pinned); print."""
    tag = f"{spec['model']}-{spec['dtype']}"
    spec_path = work / f"spec-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    if spec["start"] == "primed":
        spec["start_adapter"] = prime_once(spec, spec_path, work, env)
        spec_path.write_text(json.dumps(spec))
        steps = spec.get("prime_steps") or "the recipe's"
        sys.stdout.write(f"primed adapter (prime.max_steps: {steps}): {spec['start_adapter']}\n")
    checks = {side: run_side(side, spec_path, work, env, check_only=True) for side in SIDES}
    grpo = checks["after"]["fingerprint"]["grpo"]
    label = (f"{spec['model']} {'/'.join(checks['after']['fingerprint']['param_dtypes'])} "
             f"({grpo['per_device_train_batch_size'] * grpo['gradient_accumulation_steps'] // grpo['num_generations']}"
             f" prompts x {grpo['num_generations']} x {grpo['max_completion_length']} tokens, micro-batch "
             f"{grpo['per_device_train_batch_size']} x {grpo['gradient_accumulation_steps']}, beta {grpo['beta']}, "
             f"start {spec['start']}, {spec['steps']} steps, {repeats} run(s) a side; "
             f"before: {' '.join(spec['before'])})")
    check_sides(checks, label)  # before any timing
    for side in SIDES:
        sys.stdout.write(f"{side}: lowmem_grpo's switches live: {json.dumps(checks[side]['layer'], sort_keys=True)}\n")
    if check_only:
        sys.stdout.write(f"check-only {label}: like for like\n")
        return
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for repeat in range(repeats):  # rotating order: a drift in the machine's load hits every side alike
        for side in SIDES[repeat % 3:] + SIDES[:repeat % 3]:
            runs[side].append(run_side(side, spec_path, work, env))
        check_sides({s: r[-1] for s, r in runs.items()}, f"{label} run {repeat + 1}", show=False)
    results = {side: combine(side_runs) for side, side_runs in runs.items()}
    if pinned:  # ours already runs at this threshold (train() pins it): the plain side with the allocator taken out
        results["plain pinned"] = combine([run_side("plain", spec_path, work, {**env, **PINNED_MALLOC})])
    print_results(label, results)
    results["label"] = label
    (work / f"results-{tag}.json").write_text(json.dumps(results, indent=1))


def reprint(work: Path) -> None:
    """The tables again, from the results-*.json files a run left in its work folder."""
    for path in sorted(work.glob("results-*.json")):
        results = json.loads(path.read_text())
        print_results(results.pop("label", path.stem), results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2", help="tiny and/or smollm2 (comma-separated)")
    parser.add_argument("--dtypes", default="auto", help="auto (the recipe's) and/or float32, bfloat16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, rotating the order; medians")
    parser.add_argument("--start", choices=("primed", "fresh"), default="primed",
                        help="GRPO from the recipe's primed adapter (as the CPU default) or a fresh LoRA")
    parser.add_argument("--before", nargs="+", default=BEFORE, metavar="KEY=VALUE",
                        help=f"the 'before' side's recipe overrides (default: {' '.join(BEFORE)})")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for all three sides (another shape than the CPU default's)")
    parser.add_argument("--no-pinned", action="store_true", help="skip the plain run with MALLOC_MMAP_THRESHOLD_")
    parser.add_argument("--check-only", action="store_true",
                        help="prime one step, check the budget and the three sides' fingerprints, time nothing")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--reprint", action="store_true", help="print the tables of an earlier run's --work folder")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="step_cpu-"))
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), work, args.check_only)
        return
    if args.reprint:
        reprint(work)
        return
    work.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"load average {_load()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
                     f"LOWMEM_GRPO_CPU_DTYPE={os.environ.get('LOWMEM_GRPO_CPU_DTYPE', 'unset')}; cpus {os.cpu_count()};"
                     f" recipe {RECIPE}; work {work}\n")
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            spec = {"model": model, "dtype": dtype, "steps": args.steps, "start": args.start, "before": args.before,
                    "prime_steps": 1 if args.check_only else None, "set": args.set}
            measure(spec, work, not args.no_pinned, args.repeats, args.check_only)
    sys.stdout.write(f"load average at the end {_load()}\n")


if __name__ == "__main__":
    main()
