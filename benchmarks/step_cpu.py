"""Like-for-like CPU benchmark: lowmem_grpo's train() vs a plain TRL + PEFT script, both built from ONE spec.

    OMP_NUM_THREADS=1 python benchmarks/step_cpu.py --models tiny --dtypes float32,bfloat16 --steps 6 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/step_cpu.py --models smollm2 --dtypes float32 --steps 3 --generations 8 \
        --max-completion-length 32

Both runners get the spec's dtype, LoRA config and init seed, the same prompts in the same order (the embedded
GSM8K sample shuffled with the same seed), the same rewards and weights and the same GRPOConfig values. The plain
script uses the CPU-safe GRPOTrainer subclass too (TRL 1.15's log-prob pass is a Triton kernel with no CPU
driver) and the same phase timer (when the package has one), so both sides carry the same instrumentation.

Each side runs in its own process. From inside its trainer each worker records a fingerprint: the GRPOConfig
(minus output paths), the LoRA config, the parameter dtypes, hashes of the prompts in order and of the initial
LoRA weights, the reward names and weights, the trainer and optimizer classes, the torch thread count. The
script prints both and stops with exit 1, naming the keys, when they differ. Then, per side:
  s/step      median wall time between consecutive step ends (CPU seconds beside it; TRL's step_time too)
  start-up    process start to the first step's begin (wall and CPU)
  teardown    last step end to the end of train() (adapter, report; the plain script saves its adapter)
  faults      minor page faults and kernel CPU seconds per step (the allocator's share of a step)
  peak RSS    ru_maxrss with the default allocator, and again in a separate run with MALLOC_MMAP_THRESHOLD_=65536
              (freed large blocks go back to the OS, so the peak follows live memory: the like-for-like figure;
              with the default allocator ~1 GiB of a smollm2 peak is heap retention that moves between runs);
              that run's CPU s/step too: glibc's dynamic mmap threshold follows each process's allocation
              history, so with the default allocator the same step can fault more pages in one process than
              in the other, and the pinned runs compare the steps with that taken out
and the phase breakdown (time/<phase> keys), the ratios ours/plain (medians over --repeats runs a side, run in
alternating order, and the ratio of the minima: load on shared cores only ever adds time), the phase timer's own
cost per step (a microbenchmark of the same wrappers and callback events) and the load average. Shared cores:
read the CPU columns and the ratios, not the absolute wall times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPEC: dict[str, Any] = {  # the one source of truth for both runners; main() sets model, dtype, steps and sizes
    "model": "tiny", "dtype": "float32", "steps": 6, "seed": 42,
    "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": TARGET_MODULES},
    "data": {"max_prompt_length": 192, "shuffle_seed": 42, "prefill": "<reasoning>\n"},
    "grpo": {"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
             "max_completion_length": 64, "temperature": 1.0, "learning_rate": 1e-4, "adam_beta1": 0.9,
             "adam_beta2": 0.99, "weight_decay": 0.1, "warmup_steps": 0.0, "lr_scheduler_type": "cosine",
             "max_grad_norm": 1.0, "optim": "adamw_torch", "gradient_checkpointing": False, "beta": 0.0,
             "logging_steps": 1, "save_steps": 100000},
    "rewards": {"correctness": 2.0, "integer": 0.5, "strict_format": 0.5, "soft_format": 0.5, "xml_count": 0.5},
}
RECIPE_NAMES = {"warmup_steps": "warmup_ratio"}  # GRPOConfig field -> lowmem_grpo train.* name, where they differ
IGNORED = {"output_dir", "logging_dir", "run_name"}  # per-run paths, not settings
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


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
    are not the same."""
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
        self.timer = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "PhaseTimer"), None)
        if self.check_only:
            sys.stdout.write("FINGERPRINT " + json.dumps(self.fingerprint) + "\n")
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


# ---- the two runners ---------------------------------------------------------------------------------------------

def lowmem_overrides(spec: dict[str, Any], path: str, out: Path) -> list[str]:
    """The spec as lowmem_grpo recipe overrides on the CPU recipe."""
    j = json.dumps  # JSON is YAML: every value keeps its type
    lora = spec["lora"]
    return [
        f"model.name={path}", "model.backend=hf", f"model.dtype={spec['dtype']}", "train.precision=fp32",
        f"output.dir={out}", f"train.max_steps={spec['steps']}", f"train.seed={spec['seed']}",
        f"lora.r={lora['r']}", f"lora.alpha={lora['alpha']}", f"lora.dropout={lora['dropout']}",
        f"lora.target_modules={j(lora['target_modules'])}", "data.source=embedded",
        *(f"data.{k}={j(v)}" for k, v in spec["data"].items()),
        *(f"train.{RECIPE_NAMES.get(k, k)}={j(v)}" for k, v in spec["grpo"].items()),
        f"rewards={j(spec['rewards'])}", "train.preflight=false", "prime.enabled=false", "train.stage_eval=0",
        "train.eval_every=0",
    ]


def run_lowmem(spec: dict[str, Any], path: str, out: Path, probe: Probe) -> None:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    train(load_recipe(RECIPE, lowmem_overrides(spec, path, out)), callbacks=[probe])


def plain_rows(spec: dict[str, Any], tokenizer: Any) -> list[dict[str, Any]]:
    """The training rows as a plain script builds them: the same file, seed, prompt text, length rule, columns."""
    import random

    from lowmem_grpo.recipe import DEFAULT_SYSTEM_PROMPT

    d = spec["data"]
    lines = (REPO / "lowmem_grpo/resources/gsm8k/train.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    random.Random(d["shuffle_seed"]).shuffle(rows)
    out = []
    for row in rows:
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + d["prefill"]
        if len(tokenizer(prompt)["input_ids"]) <= d["max_prompt_length"]:
            out.append({"prompt": prompt, "answer": row["answer"].split("####")[-1].strip().replace(",", ""),
                        "question": row["question"], "solution": row["answer"], "prefill": d["prefill"]})
    return out


def run_plain(spec: dict[str, Any], path: str, out: Path, probe: Probe) -> None:
    """What a user writes by hand with TRL + PEFT, from the same spec."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig

    from lowmem_grpo import rewards
    from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec["dtype"]))
    lora = spec["lora"]
    set_seed(spec["seed"])  # LoRA A comes from the global RNG, which torch 2.14 seeds randomly per process
    model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                             bias="none", task_type="CAUSAL_LM",
                                             target_modules=lora["target_modules"]))
    config = GRPOConfig(output_dir=str(out), max_steps=spec["steps"], seed=spec["seed"], save_strategy="steps",
                        report_to=[], use_cpu=True, bf16=False, fp16=False, disable_tqdm=True,
                        reward_weights=list(spec["rewards"].values()), **spec["grpo"])
    trainer = CpuSafeGRPOTrainer(model=model, reward_funcs=[rewards.get_reward(n) for n in spec["rewards"]],
                                 args=config, train_dataset=Dataset.from_list(plain_rows(spec, tokenizer)),
                                 processing_class=tokenizer, callbacks=[probe])
    try:  # the same instrumentation as ours, where the package has it
        from lowmem_grpo.train.callbacks import PhaseTimer

        PhaseTimer.attach(trainer)
    except ImportError:
        pass
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
        # the same draws on both sides show as the same lengths and rewards, step by step
        "draws": [[r.get("completions/mean_length"), r.get("reward")] for r in steps],
    }


def worker(side: str, spec_path: Path, work: Path, check_only: bool) -> None:
    spec = json.loads(spec_path.read_text())
    started = (_process_start(), 0.0)  # CPU time counts from the process start too
    path = model_path(spec["model"], work)
    out = Path(tempfile.mkdtemp(prefix=f"{spec['model']}-{spec['dtype']}-{side}-", dir=work))
    out.rmdir()
    probe = Probe(check_only)
    (run_lowmem if side == "lowmem" else run_plain)(spec, path, out, probe)
    done = (time.time(), time.process_time())
    result = summarize(probe, started, done)
    result["timer_cost_s"] = timer_cost_s() if probe.timer is not None else None
    sys.stdout.write("FINGERPRINT " + json.dumps(probe.fingerprint) + "\n")
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
    """One worker's fingerprint, results, load average and peak RSS (GiB)."""
    load_before = os.getloadavg()[0]
    code, stdout, stderr, rss = _run_worker(side, spec_path, work, env, check_only)
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines()
             if ln.startswith(("RESULT ", "FINGERPRINT "))}
    if code != 0 or "FINGERPRINT" not in lines or ("RESULT" not in lines and not check_only):
        raise SystemExit(f"{side} worker failed (exit {code}):\n{stderr}\nrerun: {sys.executable} {__file__} "
                         f"--worker {side} {spec_path} --work {work}")
    result = lines.get("RESULT", {})
    result.update(fingerprint=lines["FINGERPRINT"], load=f"{load_before:.1f}->{os.getloadavg()[0]:.1f}",
                  peak_rss_gib=rss)
    return result


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_results(label: str, results: dict[str, dict[str, Any]]) -> None:
    """The per-side table, the ratios ours/plain and the phase breakdown."""
    cols = [("s/step", "s_per_step", ".3f"), ("cpu s/step", "cpu_per_step", ".3f"),
            ("TRL step_time", "trl_step_time", ".3f"),
            ("start-up s", "startup_wall", ".2f"), ("start-up cpu", "startup_cpu", ".2f"),
            ("teardown s", "teardown_wall", ".2f"), ("teardown cpu", "teardown_cpu", ".2f"),
            ("minor faults/step", "minflt_per_step", ".0f"), ("sys s/step", "sys_per_step", ".3f"),
            ("RSS GiB", "peak_rss_gib", ".3f"), ("pinned: RSS GiB", "peak_rss_pinned_gib", ".3f"),
            ("pinned: cpu s/step", "cpu_per_step_pinned", ".3f"),
            ("pinned: faults/step", "minflt_per_step_pinned", ".0f")]
    out = [f"\n## {label}", "| runner | " + " | ".join(c[0] for c in cols) + " | 1-min load (before->after) |",
           "|---" * (len(cols) + 2) + "|"]
    for side in ("plain", "lowmem"):
        r = results[side]
        out.append(f"| {side} | " + " | ".join(_fmt(r.get(k), f) for _, k, f in cols) + f" | {r['load']} |")
    ratios = []
    for _, key, _ in cols:
        a, b = results["lowmem"].get(key), results["plain"].get(key)
        ratios.append(_fmt(a / b if isinstance(a, (int, float)) and b else None, ".3f"))
    out.append("| ratio ours/plain | " + " | ".join(ratios) + " | |")
    ours, plain = results["lowmem"], results["plain"]
    out.append(f"start-up difference ours - plain: {ours['startup_wall'] - plain['startup_wall']:+.2f} s wall, "
               f"{ours['startup_cpu'] - plain['startup_cpu']:+.2f} s CPU")
    for key in ("cpu_per_step", "s_per_step", "startup_cpu"):
        per_run = {side: [r[key] for r in results[side]["runs"]] for side in ("plain", "lowmem")}
        if len(per_run["plain"]) > 1:
            low = min(per_run["lowmem"]) / min(per_run["plain"])
            out.append(f"{key} per run: plain {[round(v, 3) for v in per_run['plain']]}, lowmem "
                       f"{[round(v, 3) for v in per_run['lowmem']]}; ratio of the minima {low:.3f}")
    same = results["lowmem"]["draws"] == results["plain"]["draws"]
    out.append(f"completions (mean length, reward) per step: plain {results['plain']['draws']}, lowmem "
               f"{results['lowmem']['draws']}: {'the same draws' if same else 'DIFFERENT draws'} on both sides")
    out += phase_lines(results)
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def phase_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Phase means side by side (steps after the first), and the timer's own cost per step."""
    try:
        from lowmem_grpo.rundir.telemetry import PHASES, phase_means
    except ImportError:
        return ["(no phase timing in this package version)"]
    means = {side: phase_means(results[side]["phase_records"]) for side in ("plain", "lowmem")}
    if not means["lowmem"]:
        return ["(no phase timing logged)"]
    out = ["", "| phase | plain s | lowmem s | lowmem share |", "|---|---|---|---|"]
    for key in [f"time/{p}" for p in PHASES] + ["time/step", "time/sampling_share", "tokens_per_s"]:
        p, o = means["plain"].get(key), means["lowmem"].get(key)
        is_seconds = key.startswith("time/") and key != "time/sampling_share"
        share = o / means["lowmem"]["time/step"] if o is not None and is_seconds else None
        out.append(f"| {key} | {_fmt(p, '.4f')} | {_fmt(o, '.4f')} | {_fmt(share, '.1%')} |")
    # generation, loss, backward and the optimizer run the same code on both sides (the same draws): their
    # differences are the machine's noise. Our layer's per-step code runs in these three phases only.
    ours_keys = ["time/rewards", "time/other", "time/checkpoint_telemetry"]
    if means["plain"]:
        extra = sum(means["lowmem"].get(k, 0.0) - means["plain"].get(k, 0.0) for k in ours_keys)
        out.append(f"our layer's own per-step cost (lowmem - plain in {', '.join(ours_keys)}): {extra * 1e3:+.2f} ms"
                   f" = {extra / means['plain']['time/step']:+.3%} of plain's step")
    cost, step = results["lowmem"].get("timer_cost_s"), results["lowmem"].get("s_per_step")
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


def measure(spec: dict[str, Any], work: Path, pinned: bool, repeats: int) -> None:
    """Check the two sides' configurations, then run both `repeats` times in alternating order (and their
    pinned-allocator RSS runs); print."""
    label = (f"{spec['model']} {spec['dtype']} ({spec['grpo']['num_generations']} x "
             f"{spec['grpo']['max_completion_length']} tokens, batch {spec['grpo']['per_device_train_batch_size']}, "
             f"{spec['steps']} steps, {repeats} run(s) a side)")
    spec_path = work / f"spec-{spec['model']}-{spec['dtype']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    checks = {side: run_side(side, spec_path, work, env, check_only=True) for side in ("plain", "lowmem")}
    check_same(checks["lowmem"]["fingerprint"], checks["plain"]["fingerprint"], label)  # before any timing
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "lowmem": []}
    for repeat in range(repeats):  # alternating order: a drift in the machine's load hits both sides alike
        for side in ("plain", "lowmem") if repeat % 2 == 0 else ("lowmem", "plain"):
            runs[side].append(run_side(side, spec_path, work, env))
            check_same(runs[side][-1]["fingerprint"], checks[side]["fingerprint"], f"{label} {side} run {repeat + 1}",
                       show=False)
    results = {side: combine(side_runs) for side, side_runs in runs.items()}
    if pinned:  # the allocator's history taken out: RSS follows live memory, and no run reuses retained heap
        for side in ("plain", "lowmem"):
            run = run_side(side, spec_path, work, {**env, **PINNED_MALLOC})
            results[side].update(peak_rss_pinned_gib=run["peak_rss_gib"], cpu_per_step_pinned=run["cpu_per_step"],
                                 minflt_per_step_pinned=run["minflt_per_step"])
    print_results(label, results)
    results["label"] = label
    (work / f"results-{spec['model']}-{spec['dtype']}.json").write_text(json.dumps(results, indent=1))


def reprint(work: Path) -> None:
    """The tables again, from the results-*.json files a run left in its work folder."""
    for path in sorted(work.glob("results-*.json")):
        results = json.loads(path.read_text())
        print_results(results.pop("label", path.stem), results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--generations", type=int, default=SPEC["grpo"]["num_generations"])
    parser.add_argument("--batch", type=int, default=SPEC["grpo"]["per_device_train_batch_size"])
    parser.add_argument("--max-completion-length", type=int, default=SPEC["grpo"]["max_completion_length"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating the order; medians")
    parser.add_argument("--no-pinned", action="store_true", help="skip the MALLOC_MMAP_THRESHOLD_ peak-RSS runs")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--reprint", action="store_true", help="print the tables of an earlier run's --work folder")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
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
                     f"cpus {os.cpu_count()}; work {work}\n")
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            grpo = dict(SPEC["grpo"], num_generations=args.generations, per_device_train_batch_size=args.batch,
                        max_completion_length=args.max_completion_length)
            measure(dict(SPEC, model=model, dtype=dtype, steps=args.steps, grpo=grpo), work, not args.no_pinned,
                    args.repeats)
    sys.stdout.write(f"load average at the end {_load()}\n")


if __name__ == "__main__":
    main()
