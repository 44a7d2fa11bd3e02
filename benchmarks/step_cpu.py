"""CPU step time and peak RSS: lowmem_grpo vs a plain TRL + PEFT script with identical settings.

    python benchmarks/step_cpu.py --steps 5 --models tiny,smollm2

Each (model, runner) pair runs in its own process so that peak RSS is its own. Both runners use the
same prompts, rewards, LoRA and GRPOConfig values; the plain script uses the CPU-safe GRPOTrainer
subclass too, because TRL 1.15's own log-prob pass is a Triton kernel that has no CPU driver.
Prints seconds per step (mean of TRL's step_time after the first step), wall time, peak RSS and
the ratio lowmem / plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
SETTINGS = {"num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 64,
            "learning_rate": 1e-4, "lora_r": 16, "lora_alpha": 32, "max_prompt_length": 192}


def model_path(name: str, work: Path) -> str:
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import build_tiny_model

        target = work / "tiny"
        if not (target / "config.json").exists():
            build_tiny_model(target)
        return str(target)
    from lowmem_grpo.backends.embedded import embedded_model_dir

    return str(embedded_model_dir("embedded:smollm2-135m-instruct"))


def run_lowmem(path: str, steps: int, out: Path) -> list[float]:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rundir.telemetry import read_metrics
    from lowmem_grpo.train.pipeline import train

    s = SETTINGS
    recipe = load_recipe(RECIPE, [
        f"model.name={path}", "model.backend=hf", f"train.max_steps={steps}", f"output.dir={out}",
        f"train.num_generations={s['num_generations']}", f"train.per_device_train_batch_size={s['per_device_train_batch_size']}",
        f"train.max_completion_length={s['max_completion_length']}", f"train.learning_rate={s['learning_rate']}",
        f"lora.r={s['lora_r']}", f"lora.alpha={s['lora_alpha']}", f"data.max_prompt_length={s['max_prompt_length']}",
        "train.save_steps=100000", "train.preflight=false", "prime.enabled=false",
    ])
    train(recipe)
    return [m["step_time"] for m in read_metrics(out) if m.get("stage") == "grpo" and "step_time" in m]


def run_plain(path: str, steps: int, out: Path) -> list[float]:
    """What a user would write by hand with TRL + PEFT, with the same settings."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from lowmem_grpo import rewards
    from lowmem_grpo.recipe import DEFAULT_SYSTEM_PROMPT
    from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer

    s = SETTINGS
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    rows = [json.loads(line) for line in (REPO / "lowmem_grpo/resources/gsm8k/train.jsonl").read_text().splitlines()]
    prefill = "<reasoning>\n"
    data = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
            tokenize=False, add_generation_prompt=True) + prefill
        if len(tokenizer(prompt)["input_ids"]) <= s["max_prompt_length"]:
            data.append({"prompt": prompt, "answer": row["answer"].split("####")[-1].strip().replace(",", ""),
                         "prefill": prefill})
    config = GRPOConfig(
        output_dir=str(out), max_steps=steps, num_generations=s["num_generations"],
        per_device_train_batch_size=s["per_device_train_batch_size"], max_completion_length=s["max_completion_length"],
        learning_rate=s["learning_rate"], adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_steps=0.0,
        lr_scheduler_type="cosine", max_grad_norm=1.0, optim="adamw_torch", gradient_checkpointing=False,
        logging_steps=1, save_steps=100000, seed=42, report_to=[], use_cpu=True, bf16=False, fp16=False,
        reward_weights=list(rewards.GSM8K_DEFAULT_WEIGHTS.values()), disable_tqdm=True,
    )
    step_times: list[float] = []

    class Collect(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs:
                step_times.append(logs["step_time"])

    trainer = CpuSafeGRPOTrainer(
        model=model, reward_funcs=[rewards.get_reward(n) for n in rewards.GSM8K_DEFAULT_WEIGHTS], args=config,
        train_dataset=Dataset.from_list(data).shuffle(seed=42), processing_class=tokenizer, callbacks=[Collect()],
    )
    trainer.train()
    return step_times


def worker(model: str, runner: str, steps: int, work: Path) -> None:
    path = model_path(model, work)
    out = Path(tempfile.mkdtemp(prefix=f"{model}-{runner}-", dir=work))
    out.rmdir()
    started = time.monotonic()
    times = (run_lowmem if runner == "lowmem" else run_plain)(path, steps, out)
    wall = time.monotonic() - started
    sys.stdout.write("RESULT " + json.dumps({"step_times": times, "wall_s": wall}) + "\n")


def measure(model: str, runner: str, steps: int, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", model, runner, "--steps", str(steps), "--work", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not a running maximum
    proc.returncode = os.waitstatus_to_exitcode(status)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{model}/{runner} failed (exit {proc.returncode}); rerun the worker to see its log:\n  {' '.join(cmd)}")
    result = json.loads(line[len("RESULT "):])
    times = result["step_times"][1:] or result["step_times"]
    result["s_per_step"] = sum(times) / len(times)
    result["peak_rss_gb"] = usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "RUNNER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="step_cpu-"))
    if args.worker:
        worker(args.worker[0], args.worker[1], args.steps, work)
        return
    rows = []
    for model in args.models.split(","):
        results = {runner: measure(model, runner, args.steps, work) for runner in ("plain", "lowmem")}
        rows.append((model, results))
    sys.stdout.write(f"{'model':<8} {'runner':<7} {'s/step':>7} {'wall s':>7} {'peak RSS GB':>11}\n")
    for model, results in rows:
        for runner, r in results.items():
            sys.stdout.write(f"{model:<8} {runner:<7} {r['s_per_step']:7.2f} {r['wall_s']:7.1f} {r['peak_rss_gb']:11.2f}\n")
        ratio_t = results["lowmem"]["s_per_step"] / results["plain"]["s_per_step"]
        ratio_m = results["lowmem"]["peak_rss_gb"] / results["plain"]["peak_rss_gb"]
        sys.stdout.write(f"{model:<8} ratio   {ratio_t:7.3f} {'':>7} {ratio_m:11.3f}   (lowmem / plain; target < 1.05)\n")


if __name__ == "__main__":
    main()
