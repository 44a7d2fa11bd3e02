"""CPU speed and memory of the CPU default (recipes/smollm2_135m_arith_cpu.py), one sub-command per measurement.

    OMP_NUM_THREADS=2 python benchmarks/cpu_speed.py step --models smollm2 --steps 6 --repeats 2
    OMP_NUM_THREADS=2 LOWMEM_GRPO_CPU_DTYPE=float32 python benchmarks/cpu_speed.py step --models smollm2 --steps 6
    OMP_NUM_THREADS=1 python benchmarks/cpu_speed.py step --models tiny --dtypes float32,bfloat16 --steps 6 --repeats 3
    OMP_NUM_THREADS=2 python benchmarks/cpu_speed.py profile --what step --out /tmp/profile-step
    OMP_NUM_THREADS=2 python benchmarks/cpu_speed.py profile --what decode --out /tmp/decode --repeats 2
    OMP_NUM_THREADS=2 python benchmarks/cpu_speed.py sampling --dtypes auto --rows 32 --tokens 48 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/cpu_speed.py shared-prompt --dtype float32 --repeats 5
    OMP_NUM_THREADS=2 python benchmarks/cpu_speed.py allocator --thresholds 0,65536,8388608
    python benchmarks/cpu_speed.py rss --loads default

`SUB-COMMAND --help` says what one measures. Every one prints the load average (busy shared cores: read the CPU
columns). tests/test_step_cpu_check.py checks the step commands above (--check-only, parsed from this docstring).
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

RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")  # the CPU default: every measurement's spec
GIB = 2**30


def load_line() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def run_child(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
              ) -> tuple[int, str, str, Any]:
    """A child process: exit code, stdout, the tail of stderr, and its own rusage (its own peak RSS)."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env, cwd=cwd)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.stdout.close()
        errors.seek(0)
        return os.waitstatus_to_exitcode(status), stdout, errors.read()[-3000:], usage


def cpu_trainer(overrides: list[str], run_dir: Path, moved_lora: bool = False) -> tuple[Any, Any, list[dict]]:
    """(trainer, loaded model, training examples) of the CPU default as train() builds them; `moved_lora`: LoRA B
    drawn at random (seeded), so that the adapter moves the outputs as a primed one does."""
    from lowmem_grpo import backends
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(RECIPE, [*overrides, f"output.dir={run_dir}"])
    runtime, _ = backends.start(recipe, Launch())
    import torch
    from datasets import Dataset

    from lowmem_grpo.data import load_train_rows, recipe_examples
    from lowmem_grpo.recipe import resolved_rewards
    from lowmem_grpo.rewards import get_reward
    from lowmem_grpo.train.grpo import trainer_factory

    loaded = backends.load(recipe, runtime)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters() if moved_lora else ():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    examples = recipe_examples(load_train_rows(recipe.data), loaded.tokenizer, recipe.data)
    weights = resolved_rewards(recipe)
    trainer = trainer_factory(loaded, Dataset.from_list(examples), Path(run_dir), [get_reward(n) for n in weights],
                              list(weights.values()), [])(recipe)
    trainer.model.train()  # TRL samples and scores with the model in training mode
    return trainer, loaded, examples


def profile_table(prof: Any, title: str, rows: int = 30) -> str:
    return f"{title}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ---- step: the like-for-like check (pure: tested in tests/test_step_cpu_check.py) -------------------------------

SIDES = ("plain", "before", "after")
BEFORE = ["train.cpu.fast=false"]  # the "before" side's switches (--before replaces them)
BENCH_OVERRIDES = ["train.preflight.enabled=false", "train.eval.stage.problems=0", "train.eval.every=0"]  # no eval
PLAIN_TRAINER = {"lowmem_shared_prompt": False, "lowmem_merged_sampling": False, "lowmem_cpu_attention": False}
IGNORED = {"output_dir", "logging_dir", "run_name"}  # per-run paths, not settings
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def documented_commands(doc: str | None = None) -> list[tuple[dict[str, str], list[str]]]:
    """The step commands this docstring gives, as (environment settings, arguments after `step`)."""
    out = []
    for line in (doc or __doc__).splitlines():
        words = shlex.split(line) if "benchmarks/cpu_speed.py step " in line else []
        if words:
            at = words.index("benchmarks/cpu_speed.py")
            out.append((dict(w.split("=", 1) for w in words[:at] if "=" in w), words[at + 2:]))
    return out


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
    """Print both configurations (unless `show` is off and they agree); exit 1 naming the keys that differ."""
    diffs = compare(ours, plain)
    if show or diffs:
        sys.stdout.write(f"config {label} lowmem: {json.dumps(ours, sort_keys=True)}\n")
        sys.stdout.write(f"config {label} plain:  {json.dumps(plain, sort_keys=True)}\n")
    if diffs:
        sys.stderr.write(f"\nNOT LIKE FOR LIKE ({label}): the two runners differ in {len(diffs)} key(s):\n  "
                         + "\n  ".join(diffs) + "\n")
        raise SystemExit(f"configurations differ ({label}): {', '.join(d.split(':')[0] for d in diffs)}")
    sys.stdout.write(f"config {label}: identical on both sides\n")


def side_overrides(spec: dict[str, Any], side: str, path: str, out: Path) -> list[str]:
    """What the benchmark changes in the recipe for `side` (prime, plain, before, after)."""
    overrides = [f"model.name={path}", f"output.dir={out}", f"train.max_steps={spec['steps']}", *BENCH_OVERRIDES]
    overrides += [f"model.dtype={spec['dtype']}"] if spec["dtype"] != "auto" else []
    overrides += spec.get("set", [])
    if side == "prime":
        return [*overrides, "prime.enabled=true", *([f"prime.max_steps={spec['prime_steps']}"]
                                                    if spec.get("prime_steps") else [])]
    overrides += ["prime.enabled=false"] + ([f"lora.init_adapter={spec['start_adapter']}"]
                                            if spec.get("start_adapter") else [])
    return overrides + (spec["before"] if side == "before" else [])


def plain_grpo_values(recipe: Any) -> dict[str, Any]:
    """The GRPOConfig values a plain script gets from the recipe: its GRPOConfig fields, the extra fields, and those
    lowmem_grpo resolves (warmup_ratio is TRL 1.x's float warmup_steps; optim and precision auto as on CPU)."""
    from trl import GRPOConfig

    fields, t = {f.name for f in dataclasses.fields(GRPOConfig)}, recipe.train
    values = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name in fields}
    values.update(t.extra)
    values.update(warmup_steps=t.warmup_ratio, optim="adamw_torch" if t.optim == "auto" else t.optim,
                  report_to=[] if t.report_to == "none" else [t.report_to], save_total_limit=None,
                  bf16=t.precision == "bf16", fp16=t.precision == "fp16")
    return values


# ---- step: inside a worker, the fingerprint, the step marks, the plain script --------------------------------

def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset, list, tuple)):
        items = [_jsonable(v) for v in value]
        return sorted(items) if isinstance(value, (set, frozenset)) else items
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def fingerprint(trainer: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """What the trainer is about to train with, read from the trainer itself."""
    import torch

    peft = model.peft_config["default"].to_dict()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data, inner = trainer.train_dataset, getattr(optimizer, "optimizer", optimizer)
    return _jsonable({
        "trainer_class": type(trainer).__name__,
        "grpo": {k: v for k, v in trainer.args.to_dict().items() if k not in IGNORED},
        "lora": {k: v for k, v in peft.items() if k not in {"base_model_name_or_path", "revision"}},
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable_params": sum(p.numel() for _, p in trainable),
        "prompts_sha": _sha("\x1e".join(data["prompt"]).encode()),
        "rows_sha": _sha(json.dumps(data.to_list(), sort_keys=True).encode()),
        "columns": sorted(data.column_names),
        "lora_init_sha": _sha(b"".join(n.encode() + p.detach().float().cpu().numpy().tobytes() for n, p in trainable)),
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


class Callback:
    """A trainer callback, duck-typed (no transformers import here): undefined events do nothing."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class Probe(Callback):
    """The fingerprint at train begin, wall and CPU marks at each step's begin and end, and the logged records."""

    def __init__(self, check_only: bool) -> None:
        self.check_only, self.fingerprint, self.layer, self.timer = check_only, {}, {}, None
        self.begins, self.ends, self.logs = [], [], []  # (wall, cpu); (wall, cpu, minor faults, sys s); records

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        trainer = _calling_trainer()
        self.fingerprint, self.layer = fingerprint(trainer, model, optimizer), layer(trainer)
        self.timer = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "PhaseTimer"), None)
        if self.check_only:
            sys.stdout.write(f"FINGERPRINT {json.dumps(self.fingerprint)}\nLAYER {json.dumps(self.layer)}\n")
            sys.stdout.flush()
            os._exit(0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begins.append((time.time(), time.process_time()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)  # page faults and kernel time: the allocator's share
        self.ends.append((time.time(), time.process_time(), usage.ru_minflt, usage.ru_stime))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logs += [dict(logs)] if logs else []


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
    from lowmem_grpo.train.callbacks import PhaseTimer
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer

    path, lora = recipe.model.name, recipe.lora
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = resolve(recipe, Launch(), CudaFacts(torch_cuda=None, available=False)).dtype  # as train() on CPU
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    set_seed(recipe.train.seed)  # LoRA A comes from the global RNG, which torch seeds randomly per process
    model = PeftModel.from_pretrained(model, lora.init_adapter, is_trainable=True) if lora.init_adapter else \
        get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                                         task_type="CAUSAL_LM", target_modules=lora.target_modules))
    weights = resolved_rewards(recipe)
    config = GRPOConfig(output_dir=str(out), save_strategy="steps", use_cpu=True, disable_tqdm=True,
                        reward_weights=list(weights.values()), **plain_grpo_values(recipe))
    rows = recipe_examples(load_train_rows(recipe.data), tokenizer, recipe.data)
    trainer = CpuSafeGRPOTrainer(model=model, reward_funcs=[get_reward(n) for n in weights], args=config,
                                 train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[probe])
    for name, value in PLAIN_TRAINER.items():  # only the Triton log-prob kernel replaced
        setattr(trainer, name, value)
    PhaseTimer.attach(trainer)  # the same instrumentation as ours
    trainer.train()
    trainer.save_model(str(out / "adapter"))


def timer_cost_s(steps: int = 2000) -> float:
    """The phase timer's own seconds per step, at most: a step's events and spans around phases that do nothing."""
    from lowmem_grpo.train.callbacks import PhaseTimer

    trainer = SimpleNamespace(accelerator=SimpleNamespace(device=SimpleNamespace(type="cpu")),
                              callback_handler=SimpleNamespace(callbacks=[]), add_step_metrics=lambda record: None)
    timer, state = PhaseTimer.attach(trainer), SimpleNamespace(global_step=0, max_steps=10**9)

    def run() -> float:
        started = time.perf_counter()
        for _ in range(steps):
            timer.on_step_begin(None, state, None)
            with timer.span("_prepare"):
                with timer.span("generation"):
                    timer.count_tokens(512)
                with timer.span("rewards"):
                    pass
            with timer.span("loss_forward"):
                timer.open("backward")
            timer.close("backward")
            for event in (timer.on_pre_optimizer_step, timer.on_optimizer_step, timer.on_step_end):
                event(None, state, None)
        return (time.perf_counter() - started) / steps

    return min(run() for _ in range(5))


def model_path(name: str, work: Path) -> str:
    """The tiny test model (built once in the work folder) or the embedded SmolLM2 (converted once)."""
    if name == "tiny":
        if not (work / "tiny" / "config.json").exists():
            sys.path.insert(0, str(REPO / "tests"))
            from tiny import build_tiny_model

            build_tiny_model(work / "tiny")
        return str(work / "tiny")
    if name != "smollm2":
        raise SystemExit(f"--models: {name!r} is neither tiny nor smollm2")
    from lowmem_grpo.backends.embedded import embedded_model_dir

    return str(embedded_model_dir("embedded:smollm2-135m-instruct"))


def summarize(probe: Probe, started: tuple[float, float], done: tuple[float, float]) -> dict[str, Any]:
    """Start-up, s/step (wall and CPU, between step ends), teardown and the logged phase records of one run."""
    ends, median = probe.ends, _median
    gaps = [[b[i] - a[i] for a, b in zip(ends, ends[1:])] for i in range(4)]
    steps = [r for r in probe.logs if "step_time" in r]
    return {
        "s_per_step": median(gaps[0] or [ends[0][0] - probe.begins[0][0]]),
        "cpu_per_step": median(gaps[1] or [ends[0][1] - probe.begins[0][1]]), "steps": len(ends),
        "minflt_per_step": median(gaps[2]), "sys_per_step": median(gaps[3]),
        "trl_step_time": median([r["step_time"] for r in steps[1:] or steps]),
        "startup_wall": probe.begins[0][0] - started[0], "startup_cpu": probe.begins[0][1],
        "teardown_wall": done[0] - ends[-1][0], "teardown_cpu": done[1] - ends[-1][1],
        "phase_records": [{k: v for k, v in r.items() if k.startswith("time/") or k == "tokens_per_s"}
                          for r in steps[1:] or steps],
        "draws": [[r.get("completions/mean_length"), r.get("reward")] for r in steps],  # the same draws: the same
    }


def step_worker(side: str, spec_path: Path, work: Path, check_only: bool) -> None:
    from lowmem_grpo.recipe_io import load_recipe

    spec = json.loads(spec_path.read_text())
    started = (_process_start(), 0.0)  # CPU time counts from the process start too
    path = model_path(spec["model"], work)
    out = Path(tempfile.mkdtemp(prefix=f"{spec['model']}-{spec['dtype']}-{side}-", dir=work))
    out.rmdir()
    recipe = load_recipe(RECIPE, side_overrides(spec, side, path, out))
    probe = Probe(check_only or side == "prime")  # priming: stop where GRPO would begin
    if side == "plain":
        run_plain(recipe, out, probe)
    else:
        from lowmem_grpo.train.pipeline import train

        train(recipe, callbacks=[probe])
    result = summarize(probe, started, (time.time(), time.process_time()))
    result["timer_cost_s"] = timer_cost_s() if probe.timer is not None else None
    sys.stdout.write(f"FINGERPRINT {json.dumps(probe.fingerprint)}\nLAYER {json.dumps(probe.layer)}\n"
                     f"RESULT {json.dumps(result)}\n")


# ---- step: the parent, run, check, print ------------------------------------------------------------------------

def run_side(side: str, spec_path: Path, work: Path, env: dict[str, str], check_only: bool = False) -> dict[str, Any]:
    """One worker's fingerprint, live switches, results, load average and peak RSS (GiB)."""
    load_before = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "step", "--worker", side, str(spec_path), "--work", str(work)]
    code, stdout, stderr, usage = run_child(cmd + (["--check-only"] if check_only else []), env)
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines()
             if ln.startswith(("RESULT ", "FINGERPRINT ", "LAYER "))}
    if code != 0 or "FINGERPRINT" not in lines or ("RESULT" not in lines and not check_only):
        raise SystemExit(f"{side} worker failed (exit {code}):\n{stderr}\nrerun: {shlex.join(cmd)}")
    return {**lines.get("RESULT", {}), "fingerprint": lines["FINGERPRINT"], "layer": lines.get("LAYER", {}),
            "load": f"{load_before:.1f}->{os.getloadavg()[0]:.1f}", "peak_rss_gib": usage.ru_maxrss / 2**20}


RATIOS = (("after", "before"), ("after", "plain"), ("before", "plain"), ("after", "plain pinned"))
COLUMNS = [("s/step", "s_per_step", ".3f"), ("cpu s/step", "cpu_per_step", ".3f"),
           ("TRL step_time", "trl_step_time", ".3f"),
           ("start-up s", "startup_wall", ".2f"), ("start-up cpu", "startup_cpu", ".2f"),
           ("teardown s", "teardown_wall", ".2f"), ("teardown cpu", "teardown_cpu", ".2f"),
           ("minor faults/step", "minflt_per_step", ".0f"), ("sys s/step", "sys_per_step", ".3f"),
           ("RSS GiB", "peak_rss_gib", ".3f")]
NUMERIC = tuple(key for _, key, _ in COLUMNS) + ("timer_cost_s",)


def print_results(label: str, results: dict[str, dict[str, Any]]) -> None:
    """The per-side table, the ratios, the draws, the phase breakdown and the costs of our layer and its timer."""
    from lowmem_grpo.rundir.telemetry import PHASES, phase_means

    rows = [s for s in ("plain", "plain pinned", "before", "after") if s in results]
    out = [f"\n## {label}", "| side | " + " | ".join(c[0] for c in COLUMNS) + " | 1-min load (before->after) |",
           "|---" * (len(COLUMNS) + 2) + "|"]
    out += [f"| {side} | " + " | ".join(_fmt(results[side].get(k), f) for _, k, f in COLUMNS)
            + f" | {results[side]['load']} |" for side in rows]
    out += [f"| ratio {a}/{b} | " + " | ".join(_fmt(_ratio(results[a].get(k), results[b].get(k)), ".3f")
                                               for _, k, _ in COLUMNS) + " | |"
            for a, b in RATIOS if a in results and b in results]
    out += [f"{side}: lowmem_grpo's switches live: {json.dumps(results[side].get('layer', {}), sort_keys=True)}"
            for side in rows]
    for key in ("cpu_per_step", "s_per_step"):
        runs = {side: [r[key] for r in results[side]["runs"]] for side in SIDES}
        if len(runs["plain"]) > 1:
            out.append(f"{key} per run: " + "; ".join(f"{s} {[round(v, 3) for v in runs[s]]}" for s in SIDES)
                       + f"; ratio of the minima after/before {min(runs['after']) / min(runs['before']):.3f}, "
                       f"after/plain {min(runs['after']) / min(runs['plain']):.3f}")
    out += ["completions (mean length, reward) per step:", *[f"  {s}: {results[s]['draws']}" for s in SIDES]]
    same = [f"{a}={b}" for a, b in (("before", "plain"), ("after", "plain"), ("after", "before"))
            if results[a]["draws"] == results[b]["draws"]]
    out.append(f"  the same draws: {', '.join(same) or 'no two sides'}")
    means = {side: phase_means(results[side]["phase_records"]) for side in SIDES}
    if not means["after"]:
        out.append("(no phase timing logged)")
    else:
        out += ["", "| phase | plain s | before s | after s | after/before | after/plain | after share |",
                "|---|---|---|---|---|---|---|"]
        for key in [f"time/{p}" for p in PHASES] + ["time/step", "time/sampling_share", "tokens_per_s"]:
            p, b, a = (means[s].get(key) for s in SIDES)
            share = a / means["after"]["time/step"] if a is not None and key.startswith("time/") \
                and key != "time/sampling_share" else None
            out.append(f"| {key} | {_fmt(p, '.4f')} | {_fmt(b, '.4f')} | {_fmt(a, '.4f')} | "
                       f"{_fmt(_ratio(a, b), '.3f')} | {_fmt(_ratio(a, p), '.3f')} | {_fmt(share, '.1%')} |")
        # our layer's per-step code (rewards guard and recorder, telemetry, callbacks) runs in these phases only
        ours = ["time/rewards", "time/other", "time/checkpoint_telemetry"]
        if means["plain"]:
            extra = sum(means["after"].get(k, 0.0) - means["plain"].get(k, 0.0) for k in ours)
            out.append(f"our layer's own per-step cost (after - plain in {', '.join(ours)}): {extra * 1e3:+.2f} ms"
                       f" = {extra / means['plain']['time/step']:+.3%} of plain's step")
        cost, step = results["after"].get("timer_cost_s"), results["after"].get("s_per_step")
        if cost is not None and step:
            out.append(f"phase timer's own cost: at most {cost * 1e6:.1f} us per step = {cost / step:.4%} of a step")
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as one result: the median of each number, the phase records pooled, every run kept."""
    out = dict(runs[0])
    for key in NUMERIC:
        out[key] = _median([r[key] for r in runs if isinstance(r.get(key), (int, float))])
    out["phase_records"] = [rec for r in runs for rec in r["phase_records"]]
    out["runs"] = [{k: r.get(k) for k in NUMERIC + ("load",)} for r in runs]
    out["load"] = "; ".join(r["load"] for r in runs)
    return out


def check_sides(checks: dict[str, dict[str, Any]], label: str, show: bool = True) -> None:
    """Each of our sides against the plain one (exit 1 naming the keys when they differ)."""
    for side in ("before", "after"):
        check_same(checks[side]["fingerprint"], checks["plain"]["fingerprint"], f"{label} {side}",
                   show=show and side == "after")  # printed once (a differing pair always is)


def measure(spec: dict[str, Any], work: Path, pinned: bool, repeats: int, check_only: bool) -> None:
    """Prime once, check the three sides' configurations, run each `repeats` times in rotating order (the
    plain side once more pinned), print."""
    tag = f"{spec['model']}-{spec['dtype']}"
    spec_path, env = work / f"spec-{tag}.json", dict(os.environ)
    spec_path.write_text(json.dumps(spec))
    if spec["start"] == "primed":  # the recipe's priming, through train(), once: the adapter every side starts from
        run_side("prime", spec_path, work, env, check_only=True)
        found = sorted(work.glob(f"{tag}-prime-*/primed_adapter"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise SystemExit(f"priming left no primed_adapter in {work}")
        spec["start_adapter"] = str(found[-1])
        spec_path.write_text(json.dumps(spec))
        steps = spec.get("prime_steps") or "the recipe's"
        sys.stdout.write(f"primed adapter (prime.max_steps: {steps}): {spec['start_adapter']}\n")
    checks = {side: run_side(side, spec_path, work, env, check_only=True) for side in SIDES}
    g = checks["after"]["fingerprint"]["grpo"]
    label = (f"{spec['model']} {'/'.join(checks['after']['fingerprint']['param_dtypes'])} "
             f"({g['per_device_train_batch_size'] * g['gradient_accumulation_steps'] // g['num_generations']}"
             f" prompts x {g['num_generations']} x {g['max_completion_length']} tokens, micro-batch "
             f"{g['per_device_train_batch_size']} x {g['gradient_accumulation_steps']}, beta {g['beta']}, "
             f"start {spec['start']}, {spec['steps']} steps, {repeats} run(s) a side; "
             f"before: {' '.join(spec['before'])})")
    check_sides(checks, label)  # before any timing
    sys.stdout.write("".join(f"{side}: lowmem_grpo's switches live: {json.dumps(checks[side]['layer'], sort_keys=True)}"
                             "\n" for side in SIDES))
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
    (work / f"results-{tag}.json").write_text(json.dumps({**results, "label": label}, indent=1))


def cmd_step(args: argparse.Namespace) -> int:
    """A GRPO step like for like: our train() before (--before's switches) and after (as shipped) its CPU switches,
    and a plain TRL + PEFT script ("plain pinned": at train()'s mmap threshold), each in its own process.

All sides come from the CPU default recipe; each worker's fingerprint must equal plain's, else exit 1 naming the
keys (--check-only stops there). Printed, medians over --repeats in rotating order: s/step, start-up, teardown,
faults, peak RSS, ratios, completions, time/<phase> means, our layer's and the phase timer's own cost."""
    work = Path(args.work or tempfile.mkdtemp(prefix="step_cpu-"))
    if args.worker:
        step_worker(args.worker[0], Path(args.worker[1]), work, args.check_only)
        return 0
    work.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"{load_line()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
                     f"LOWMEM_GRPO_CPU_DTYPE={os.environ.get('LOWMEM_GRPO_CPU_DTYPE', 'unset')}; cpus {os.cpu_count()};"
                     f" recipe {RECIPE}; work {work}\n")
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            spec = {"model": model, "dtype": dtype, "steps": args.steps, "start": args.start, "before": args.before,
                    "prime_steps": 1 if args.check_only else None, "set": args.set}
            measure(spec, work, not args.no_pinned, args.repeats, args.check_only)
    sys.stdout.write(f"at the end: {load_line()}\n")
    return 0


# ---- profile ----------------------------------------------------------------------------------------------------

class StepProfiler(Callback):
    """Profiles GRPO step `step` (train()'s callback seam) and writes its table to OUT/step.txt."""

    def __init__(self, step: int, out: Path) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.step, self.out, self.started = step, out, 0.0
        self.profiler = profile(activities=[ProfilerActivity.CPU])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            self.started = time.perf_counter()
            self.profiler.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.profiler.__exit__(None, None, None)
            text = profile_table(self.profiler, f"GRPO step {self.step}: {time.perf_counter() - self.started:.2f} s "
                                                "wall")
            (self.out / "step.txt").write_text(text)
            sys.stdout.write(text + "\n")


def eval_setup(args: argparse.Namespace) -> tuple[Any, list[str], Any]:
    """The base model of the CPU default (--set applied) and the prompts of its first --problems test problems."""
    from lowmem_grpo.backends import load, locate_model, start
    from lowmem_grpo.data import load_eval_rows, recipe_examples
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(RECIPE, list(args.set))
    loaded = load(recipe, start(recipe, Launch())[0], model_path=locate_model(recipe.model.name))
    rows = load_eval_rows(recipe.data)[:args.problems]
    return loaded, [e["prompt"] for e in recipe_examples(rows, loaded.tokenizer, recipe.data)], recipe


def profile_eval(args: argparse.Namespace) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lowmem_grpo.runtime import EVAL_BATCH
    from lowmem_grpo.sampling.generate import generate

    loaded, prompts, recipe = eval_setup(args)
    t, seconds = recipe.train, []
    common = dict(max_new_tokens=t.max_completion_length, progress=False, calculator=recipe.data.calculator,
                  batch_size=EVAL_BATCH)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for extra in ({}, dict(num_samples=args.samples, temperature=t.temperature, seed=t.seed)):
            start = time.perf_counter()
            generate(loaded.model, loaded.tokenizer, prompts, **common, **extra)
            seconds.append(time.perf_counter() - start)
    return profile_table(prof, f"evaluation of {len(prompts)} problems ({loaded.dtype}, torch threads "
                               f"{torch.get_num_threads()}): greedy {seconds[0]:.1f} s, {args.samples} samples "
                               f"{seconds[1]:.1f} s")


def compare_decode(args: argparse.Namespace) -> str:
    """The engine's decode with transformers' DynamicCache and with the preallocated cache, alternating."""
    import torch

    from lowmem_grpo.runtime import EVAL_BATCH
    from lowmem_grpo.sampling.engine import DecodeContract, sample_rows
    from lowmem_grpo.sampling.generate import fast_sampling

    loaded, prompts, recipe = eval_setup(args)
    tok, t = loaded.tokenizer, recipe.train
    ids, eos = tok(prompts)["input_ids"], {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)

    def run(preallocate: bool, k: int, temperature: float) -> tuple[float, list[list[int]]]:
        rows, start, per = [], time.perf_counter(), max(1, EVAL_BATCH // k)
        with fast_sampling(loaded.model):
            for i in range(0, len(ids), per):
                rows += sample_rows(loaded.model, [p for p in ids[i:i + per] for _ in range(k)],
                                    max_new_tokens=t.max_completion_length, temperature=temperature, eos_ids=eos,
                                    pad_id=pad, generator=torch.Generator().manual_seed(t.seed),
                                    contract=DecodeContract(preallocate=preallocate))
        return time.perf_counter() - start, [r.ids for r in rows]

    loaded.model.eval()
    lines = [f"decode of {len(ids)} problems, {loaded.dtype}, batch {EVAL_BATCH} sequences"]
    for label, k, temperature in (("greedy", 1, 0.0), (f"{args.samples} samples", args.samples, t.temperature)):
        times: dict[bool, list[float]] = {False: [], True: []}
        outputs = {}
        for _ in range(args.repeats):
            for preallocate in (False, True):
                seconds, outputs[preallocate] = run(preallocate, k, temperature)
                times[preallocate].append(seconds)
        lines.append(f"{label:10s} DynamicCache {min(times[False]):6.1f} s  preallocated {min(times[True]):6.1f} s  "
                     f"(min of {args.repeats}; ratio {min(times[True]) / min(times[False]):.2f}); rows identical: "
                     f"{outputs[False] == outputs[True]}")
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    """torch.profiler tables of one GRPO step and one evaluation of the CPU default, as the package runs them.

--what step: GRPO step --profile-step (OUT/step.txt); eval: greedy + --samples samples (OUT/eval.txt); decode:
DynamicCache vs the preallocated cache, alternating, and whether their rows agree (OUT/decode.txt)."""
    args.out.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"before: {load_line()}\n")
    if args.what == "step":
        from lowmem_grpo.recipe_io import load_recipe
        from lowmem_grpo.train.pipeline import train

        train(load_recipe(RECIPE, [f"train.max_steps={args.profile_step}", "train.preflight.enabled=false",
                                   "train.eval.stage.problems=0", "train.save_steps=1000",
                                   f"output.dir={args.out / 'run'}", *args.set]),
              callbacks=[StepProfiler(args.profile_step, args.out)])
    else:
        text = profile_eval(args) if args.what == "eval" else compare_decode(args)
        (args.out / f"{args.what}.txt").write_text(text)
        sys.stdout.write(text + "\n")
    sys.stdout.write(f"after: {load_line()}\n")
    return 0


# ---- sampling ---------------------------------------------------------------------------------------------------

CONFIGS = {"unmerged": (False, False), "merged": (True, False), "merged+grouped": (True, True)}


def sample(trainer: Any, prompt_ids: list[list[int]], group: int, merged: bool, grouped: bool
           ) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, CPU seconds and completion ids of one pass of TRL's generation in one configuration."""
    import torch

    trainer.lowmem_merged_sampling, trainer.lowmem_cpu_attention = merged, grouped
    torch.manual_seed(0)
    started, cpu = time.perf_counter(), time.process_time()
    completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, group)
    return time.perf_counter() - started, time.process_time() - cpu, [list(map(int, c)) for c in completions]


def logit_errors(trainer: Any, prompt_ids: list[list[int]]) -> str:
    """Each configuration's logits against the model loaded afresh in float32, unmerged."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.sampling.generate import fast_sampling

    width, pad, model = max(len(ids) for ids in prompt_ids), trainer.processing_class.pad_token_id, trainer.model
    batch = {"input_ids": torch.tensor([[pad] * (width - len(i)) + i for i in prompt_ids]),
             "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in prompt_ids])}
    keep = batch["attention_mask"].bool()
    model.eval()
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.float32),
                               model.peft_config["default"])
    set_peft_model_state_dict(reference, get_peft_model_state_dict(model))
    lines = [f"{'logits vs float32':17s} {'max |diff|':>10s} {'mean |diff|':>11s} {'argmax agrees':>13s}"]
    with torch.no_grad():
        ref = reference.eval()(**batch).logits[keep]
        for name, (merged, grouped) in CONFIGS.items():
            with fast_sampling(model, merged, grouped):
                logits = model(**batch).logits[keep].float()
            diff, agree = (logits - ref).abs(), (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            lines.append(f"{name:17s} {diff.max().item():10.4f} {diff.mean().item():11.5f} {agree:13.4f}")
    model.train()
    return "\n".join(lines) + "\n"


def sampling_dtype(dtype: str, args: argparse.Namespace) -> None:
    import torch
    from peft.tuners.lora import Linear
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory(prefix="sampling-bench-") as run_dir:
        overrides = [f"model.dtype={dtype}", f"train.num_generations={args.group}",
                     f"train.per_device_train_batch_size={args.rows}", f"train.max_completion_length={args.tokens}"]
        trainer, loaded, examples = cpu_trainer(overrides, Path(run_dir), moved_lora=True)
        if args.greedy:
            trainer.generation_config.do_sample = trainer.generation_kwargs["do_sample"] = False
        prompts = [ex["prompt"] for ex in examples[:args.rows // args.group] for _ in range(args.group)]
        prompt_ids = loaded.tokenizer(text=prompts)["input_ids"]
        model_dtype = next(p.dtype for p in trainer.model.parameters() if not p.requires_grad)
        merged_mib = sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size()
                         for m in trainer.model.modules() if isinstance(m, Linear)) / 2**20
        out = sys.stdout
        out.write(f"\n== dtype {dtype} -> {model_dtype}, {args.rows} rows x up to {args.tokens} tokens, "
                  f"{'greedy' if args.greedy else f'temperature {trainer.temperature}'}, "
                  f"torch threads {torch.get_num_threads()}, merged copy {merged_mib:.0f} MiB\n")
        sample(trainer, prompt_ids, args.group, False, False)  # warm-up: allocator, first-call paths
        times, cpu, texts = {name: [] for name in CONFIGS}, {name: [] for name in CONFIGS}, {}
        for r in range(args.repeats):
            for name in list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS)):
                seconds, cpu_seconds, texts[name] = sample(trainer, prompt_ids, args.group, *CONFIGS[name])
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                n = sum(len(c) for c in texts[name])
                out.write(f"  repeat {r + 1} {name:15s} {seconds:7.2f} s  {n / seconds:6.1f} tok/s  "
                          f"CPU {cpu_seconds:7.2f} s  {n / cpu_seconds:6.1f} tok/CPU-s\n")
                out.flush()
        tokens, base = {name: sum(len(c) for c in texts[name]) for name in CONFIGS}, texts["unmerged"]
        out.write(f"{'configuration':15s} {'tokens':>6s} {'steps':>5s} {'best s':>7s} {'median s':>8s} "
                  f"{'tok/s best':>10s} {'x best':>6s} {'x median':>8s} {'best CPU s':>10s} {'x CPU':>6s}  "
                  "same completions as unmerged\n")

        def speedup(name: str, pick: Any, series: dict[str, list[float]]) -> float:
            return (tokens[name] / pick(series[name])) / (tokens["unmerged"] / pick(series["unmerged"]))

        for name in CONFIGS:
            same = sum(a == b for a, b in zip(texts[name], base))
            agree = sum(x == y for a, b in zip(texts[name], base) for x, y in zip(a, b))
            out.write(f"{name:15s} {tokens[name]:6d} {max(len(c) for c in texts[name]):5d} {min(times[name]):7.2f} "
                      f"{statistics.median(times[name]):8.2f} {tokens[name] / min(times[name]):10.1f} "
                      f"{speedup(name, min, times):6.2f} {speedup(name, statistics.median, times):8.2f} "
                      f"{min(cpu[name]):10.2f} {speedup(name, min, cpu):6.2f}  {same}/{len(base)} rows, "
                      f"{agree}/{sum(len(b) for b in base)} tokens\n")
        if model_dtype != torch.float32:
            out.write(logit_errors(trainer, prompt_ids[::args.group]))
        for name in ("unmerged", "merged+grouped") if args.profile else ():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                sample(trainer, prompt_ids, args.group, *CONFIGS[name])
            out.write(profile_table(prof, f"\n-- profile {name} (one pass, self CPU) --", 15) + "\n")
        out.write(load_line() + "\n")


def cmd_sampling(args: argparse.Namespace) -> int:
    """GRPO sampling before vs after, in one process: tokens/s of TRL's generation from the CPU default's trainer.

Alternating: unmerged, merged (adapter merged), merged+grouped (GQA without copying heads); LoRA B random, seeded.
Printed: wall and CPU s and tok/s, ratios to unmerged, identical completions; in 16-bit logits against float32."""
    if args.rows % args.group:
        raise SystemExit("--rows must be a multiple of --group")
    for dtype in args.dtypes.split(","):
        sampling_dtype(dtype.strip(), args)
    return 0


# ---- shared-prompt and allocator: one loss pass -----------------------------------------------------------------

def make_batch(tokenizer: Any, prompts: int, generations: int, prompt_length: int, completion: tuple[int, int],
               seed: int) -> tuple[Any, Any, int]:
    """Rows as TRL builds them (left-padded prompts, right-padded completions) of random token ids."""
    import torch

    gen, pad, width = torch.Generator().manual_seed(seed), tokenizer.pad_token_id, completion[1]
    ids, mask = [], []
    for p in range(prompts):
        length = prompt_length - (p * 3) % 7  # prompts of slightly different lengths: real left padding
        prompt = torch.randint(3, len(tokenizer), (length,), generator=gen)
        for _ in range(generations):
            kept = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=gen))
            body = torch.randint(3, len(tokenizer), (kept,), generator=gen)
            ids.append(torch.cat([torch.full((prompt_length - length,), pad), prompt, body,
                                  torch.full((width - kept,), pad)]))
            mask.append(torch.tensor([0] * (prompt_length - length) + [1] * (length + kept) + [0] * (width - kept)))
    return torch.stack(ids), torch.stack(mask), width


def one_pass(trainer: Any, ids: Any, mask: Any, width: int, share: bool, advantages: Any) -> dict:
    """Forward and backward of one micro-batch: seconds, peak RSS rise, kernel s, faults, tokens, log-probs."""
    from lowmem_grpo.rundir import rss

    trainer.lowmem_shared_prompt = share
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    completion_mask = mask[:, -width:]
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = rss.current_bytes()
    except OSError:
        before = None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = time.perf_counter(), time.process_time()
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width,
                                                                     compute_entropy=True)
    ratio = (logps - logps.detach()).exp()  # the GRPO surrogate at the sampling policy
    loss = -((ratio * advantages.unsqueeze(1)) * completion_mask).sum() / completion_mask.sum()
    t1, c1 = time.perf_counter(), time.process_time()
    loss.backward()
    t2, c2 = time.perf_counter(), time.process_time()
    after = resource.getrusage(resource.RUSAGE_SELF)
    saved = trainer._metrics["train"].get("shared_prompt/tokens_saved", [0.0])[-1]
    return {"forward": t1 - t0, "backward": t2 - t1, "total": t2 - t0, "cpu forward": c1 - c0,
            "cpu backward": c2 - c1, "cpu total": c2 - c0, "sys": after.ru_stime - usage.ru_stime,
            "faults": after.ru_minflt - usage.ru_minflt,
            "peak_mib": None if before is None else (rss.high_water_bytes() - before) / 2**20,
            "forwarded": round(ids.numel() * (1 - saved)), "logps": logps.detach(),
            "entropy": float((entropies * completion_mask).sum() / completion_mask.sum())}


def float32_errors(trainer: Any, loaded: Any, ids: Any, mask: Any, width: int, logps: dict[str, Any]) -> list[str]:
    """Each pass's log-probs against the full-row pass of the model loaded afresh in float32."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    from lowmem_grpo import backends
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.cpu_logprobs import completion_logits

    recipe = load_recipe(RECIPE, ["model.dtype=float32"])
    reference = backends.load(recipe, backends.start(recipe, Launch())[0]).model.train()
    with torch.no_grad():
        logits = completion_logits(reference, ids, mask, width, share=False).logits.float() / trainer.temperature
    truth, real = selective_log_softmax(logits, ids[:, -width:]), mask[:, -width:].bool()
    return [f"  {name} ({loaded.dtype}) vs full rows in float32: max {(x - truth)[real].abs().max().item():.2e}, "
            f"mean {(x - truth)[real].abs().mean().item():.2e}" for name, x in logps.items()]


def cmd_shared_prompt(args: argparse.Namespace) -> int:
    """The loss pass's forward + backward with the shared-prompt log-prob pass on and off, like for like.

One micro-batch of random rows, alternating. Printed: seconds (wall, CPU), peak RSS rise (VmHWM, mmap threshold
64 KiB), tokens forwarded, ratios, the largest log-prob difference, and in 16-bit both against float32."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # peak RSS that follows live memory (see above)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    import torch

    print(f"before: {load_line()}; torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as work:
        trainer, loaded, _ = cpu_trainer([f"model.dtype={args.dtype}"], Path(work) / "run")
        ids, mask, width = make_batch(loaded.tokenizer, args.prompts, args.generations, args.prompt_length,
                                      (args.completion_min, args.completion_max), args.seed)
        advantages = torch.randn(ids.size(0), generator=torch.Generator().manual_seed(args.seed))
        print(f"model {loaded.model_path} ({loaded.dtype}), batch {tuple(ids.shape)}: {args.prompts} prompts x "
              f"{args.generations}, prompt {args.prompt_length}, completion {args.completion_min}-"
              f"{args.completion_max} of {width}; {args.repeats} repeats, alternating order, after one warm-up each")
        results: dict[bool, list[dict]] = {False: [], True: []}
        for share in (False, True):  # warm-up
            one_pass(trainer, ids, mask, width, share, advantages)
        for r in range(args.repeats):
            for share in ((False, True) if r % 2 == 0 else (True, False)):
                x = one_pass(trainer, ids, mask, width, share, advantages)
                results[share].append(x)
                print(f"  repeat {r + 1} {'shared' if share else 'full  '}: forward {x['forward']:.2f} s (cpu "
                      f"{x['cpu forward']:.2f}), backward {x['backward']:.2f} s (cpu {x['cpu backward']:.2f}), "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    names, keys = {False: "full rows", True: "shared prompt"}, ("forward", "backward", "total", "cpu forward",
                                                                 "cpu backward", "cpu total")
    print("seconds, median / minimum over the repeats (wall; cpu = this process's CPU time):")
    print(f"{'':14} " + " ".join(f"{k:>15}" for k in keys) + f" {'peak RSS +MiB':>14} {'tokens':>7}")
    for share, rs in results.items():
        cols = [f"{statistics.median([x[k] for x in rs]):6.2f} / {min(x[k] for x in rs):6.2f}" for k in keys]
        peaks = [x["peak_mib"] for x in rs if x["peak_mib"] is not None]
        peak = f"{statistics.median(peaks):.0f}" if peaks else "n/a"
        print(f"{names[share]:14} " + " ".join(f"{c:>15}" for c in cols) + f" {peak:>14} {rs[0]['forwarded']:>7}")
    for key in keys:
        full, shared = [x[key] for x in results[False]], [x[key] for x in results[True]]
        print(f"ratio full/shared {key:12}: median {statistics.median(full) / statistics.median(shared):.2f}x, "
              f"minimum {min(full) / min(shared):.2f}x")
    diff = (results[False][0]["logps"] - results[True][0]["logps"])[mask[:, -width:].bool()].abs().max().item()
    print(f"max |log-prob diff| on completion tokens, shared vs full rows ({loaded.dtype}): {diff:.2e}; mean "
          f"entropy {results[False][0]['entropy']:.4f} vs {results[True][0]['entropy']:.4f}")
    if loaded.dtype != "float32":  # 16-bit rounding differs between any two kernels: measure both against float32
        print("\n".join(float32_errors(trainer, loaded, ids, mask, width,
                                       {names[s]: results[s][0]["logps"] for s in (False, True)})))
    print(f"after: {load_line()}")
    return 0


def cmd_allocator(args: argparse.Namespace) -> int:
    """What glibc's mmap threshold costs a CPU loss pass: seconds, page faults and peak RSS at several thresholds,
    each (0 = glibc's dynamic one) in its own process."""
    if args.worker is not None:
        import torch

        from lowmem_grpo.rundir import rss

        pinned = rss.limit_heap_retention(args.worker) if args.worker else False
        trainer, loaded, _ = cpu_trainer([], Path(tempfile.mkdtemp()))
        ids, mask, width = make_batch(loaded.tokenizer, args.prompts, args.rows // args.prompts, 83, (25, 35), 0)
        advantages = torch.randn(ids.size(0), generator=torch.Generator().manual_seed(0))
        passes = [one_pass(trainer, ids, mask, width, True, advantages) for _ in range(args.repeats + 1)][1:]
        print(json.dumps({"pinned": pinned, **{k: min(p[k] for p in passes) for k in
                                               ("forward", "backward", "cpu forward", "cpu backward")},
                          **{k: statistics.fmean(p[k] for p in passes) for k in ("sys", "faults")},
                          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return 0
    print(f"before: {load_line()}")
    print(f"{'threshold':>10} {'fwd s':>6} {'bwd s':>6} {'cpu fwd':>7} {'cpu bwd':>7} {'sys s':>6} {'faults':>9} "
          f"{'peak MiB':>8}")
    for threshold in (int(t) for t in args.thresholds.split(",")):
        code, stdout, stderr, _ = run_child([sys.executable, __file__, "allocator", "--worker", str(threshold),
                                             "--prompts", str(args.prompts), "--rows", str(args.rows),
                                             "--repeats", str(args.repeats)])
        if code != 0:
            raise SystemExit(f"threshold {threshold}: the worker failed (exit {code}):\n{stderr}")
        r = json.loads(stdout.strip().splitlines()[-1])
        print(f"{threshold:>10} {r['forward']:>6.2f} {r['backward']:>6.2f} {r['cpu forward']:>7.2f} "
              f"{r['cpu backward']:>7.2f} {r['sys']:>6.2f} {r['faults']:>9.0f} {r['peak_rss_mib']:>8.0f}")
    print(f"after: {load_line()}")
    return 0


# ---- rss --------------------------------------------------------------------------------------------------------

# load name -> recipe overrides; 4x8x64: four prompts of eight completions, 64 completion tokens, one micro-batch
LOADS = {"default": [], "4x8x64": ["train.per_device_train_batch_size=32", "train.max_completion_length=64"]}


def overrides(args: argparse.Namespace, load: str, run_dir: Path) -> list[str]:
    """The recipe overrides of one rss load."""
    return [f"train.max_steps={args.steps}", f"prime.max_steps={args.prime_steps}",
            f"train.eval.stage.problems={args.stage_eval}", "train.save_steps=100000", f"output.dir={run_dir}",
            *LOADS[load], *args.overrides]


def cmd_rss(args: argparse.Namespace) -> int:
    """Peak resident memory (RSS) of CPU training, per stage and GRPO phase: the CPU default, short, and 4x8x64,
    each one `lowmem-grpo train` process; printed: seconds, load, ru_maxrss and report.md's memory tables."""
    from lowmem_grpo.rundir import layout, report, rss

    results, env = [], {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="lowmem-rss-") as work:
        for load in args.loads.split(","):
            run_dir, before, started = Path(work) / f"run-{load}", os.getloadavg()[0], time.monotonic()
            code, _, stderr, usage = run_child([sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE,
                                                *overrides(args, load, run_dir)], env, cwd=REPO)
            r = {"load": load, "command": " ".join(["lowmem-grpo train", RECIPE, *overrides(args, load, Path("RUN"))]),
                 "returncode": code, "seconds": round(time.monotonic() - started, 1),
                 "loadavg": [round(before, 2), round(os.getloadavg()[0], 2)], "process_peak": usage.ru_maxrss * 1024,
                 "peak_rss": rss.read(run_dir / layout.PEAK_RSS_FILE)}
            r.update({"error": stderr[-400:].strip()} if code else {})
            results.append(r)
            print(f"\n== {load}: {r['command']}\nexit {code}, {r['seconds']} s, load average "
                  f"{r['loadavg'][0]}/{r['loadavg'][1]}, whole run (ru_maxrss) {r['process_peak'] / GIB:.2f} GiB"
                  + (f"\n{r['error']}" if code else ""))
            print("\n".join(report.memory_lines(run_dir, layout.read_jsonl(run_dir / layout.METRICS_FILE))), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if all(r["returncode"] == 0 for r in results) else 1


# ---- the command line -------------------------------------------------------------------------------------------

def _loads(text: str) -> str:
    unknown = [name for name in text.split(",") if name not in LOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown load(s) {', '.join(unknown)}: use {', '.join(LOADS)}")
    return text


def _at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUB-COMMAND")

    def add(name: str, func: Any, *options: tuple) -> None:
        p = sub.add_parser(name, help=" ".join(func.__doc__.split("\n\n")[0].split()), description=func.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        for flags, kwargs in options:
            p.add_argument(*flags.split(), **kwargs)

    add("step", cmd_step, ("--models", dict(default="smollm2", help="tiny and/or smollm2 (comma-separated)")),
        ("--dtypes", dict(default="auto", help="auto (the recipe's) and/or float32, bfloat16")),
        ("--steps", dict(type=int, default=6)),
        ("--repeats", dict(type=int, default=1, help="runs per side, rotating the order; medians")),
        ("--start", dict(choices=("primed", "fresh"), default="primed",
                         help="GRPO from the recipe's primed adapter (as the CPU default) or a fresh LoRA")),
        ("--before", dict(nargs="+", default=BEFORE, metavar="KEY=VALUE",
                          help=f"the 'before' side's recipe overrides (default: {' '.join(BEFORE)})")),
        ("--set", dict(nargs="+", default=[], metavar="KEY=VALUE", help="recipe overrides for all three sides")),
        ("--no-pinned", dict(action="store_true", help="skip the plain run with MALLOC_MMAP_THRESHOLD_")),
        ("--check-only", dict(action="store_true",
                              help="prime one step, check the budget and the three sides' fingerprints, time nothing")),
        ("--work", dict(default=None, help="scratch folder (default: a temporary one)")),
        ("--worker", dict(nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)))
    add("profile", cmd_profile, ("--what", dict(choices=["step", "eval", "decode"], required=True)),
        ("--repeats", dict(type=int, default=2)), ("--out", dict(type=Path, required=True)),
        ("--profile-step", dict(type=int, default=3)), ("--problems", dict(type=int, default=100)),
        ("--samples", dict(type=int, default=4)), ("--set", dict(nargs="*", default=[], metavar="KEY=VALUE")))
    add("sampling", cmd_sampling, ("--dtypes", dict(default="auto", help="model.dtype values (comma-separated)")),
        ("--rows", dict(type=int, default=32, help="completions sampled at once (default 32)")),
        ("--group", dict(type=int, default=8, help="completions per prompt (default 8)")),
        ("--tokens", dict(type=int, default=48, help="tokens per completion (default 48)")),
        ("--repeats", dict(type=int, default=3)),
        ("--greedy", dict(action="store_true", help="greedy instead of the recipe's temperature")),
        ("--profile", dict(action="store_true", help="print torch.profiler's top operators")))
    add("shared-prompt", cmd_shared_prompt,
        ("--dtype", dict(default="auto", help="model.dtype (auto = bfloat16 where the CPU has it)")),
        ("--prompts", dict(type=int, default=4)), ("--generations", dict(type=int, default=8)),
        ("--prompt-length", dict(type=int, default=83)), ("--completion-min", dict(type=int, default=46)),
        ("--completion-max", dict(type=int, default=64)), ("--repeats", dict(type=int, default=5)),
        ("--seed", dict(type=int, default=0)))
    add("allocator", cmd_allocator,
        ("--thresholds", dict(default="0,65536,8388608", help="bytes, comma-separated; 0 = glibc's own")),
        ("--prompts", dict(type=int, default=1)), ("--rows", dict(type=int, default=8)),
        ("--repeats", dict(type=int, default=4)), ("--worker", dict(type=int, default=None, help=argparse.SUPPRESS)))
    add("rss", cmd_rss, ("--loads", dict(type=_loads, default=",".join(LOADS), help=f"of {', '.join(LOADS)}")),
        ("--steps", dict(type=_at_least_one, default=2, help="GRPO steps (default 2)")),
        ("--prime-steps", dict(type=_at_least_one, default=2, help="priming steps (default 2)")),
        ("--stage-eval", dict(type=_at_least_one, default=8, help="held-out problems per stage evaluation")),
        ("--out", dict(help="write the results as JSON here")),
        ("overrides", dict(nargs="*", help="recipe overrides for every load, key=value")))
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    raise SystemExit(arguments.func(arguments))
