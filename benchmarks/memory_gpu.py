"""Predicted vs measured GPU memory of GRPO steps, for every shipped recipe's architecture.

For each recipe: a model with random weights is built from the shipped config of its model
(lowmem_grpo/resources/configs; the real model's shapes, so the real memory footprint, without a
download) with a word-level tokenizer of the same vocabulary size, then a few GRPO steps run with
the recipe's settings twice, each in its own process:

  lowmem  through lowmem_grpo.train.pipeline.train (backend auto: Unsloth on CUDA)
  plain   through a plain TRL + PEFT + bitsandbytes script (no Unsloth imported)

and the table prints torch.cuda.max_memory_allocated / max_memory_reserved next to the planner's
prediction for that backend (lowmem_grpo.memory.plan: allocated_bytes and reserved_bytes), with the
error in %, and the completion tokens per second of step time. Random weights never emit EOS, so
every completion runs to max_completion_length: the planner's worst case, which it predicts.

On the lent GPU machine (the wheels come from benchmarks/build_gpu_bundle.py; carry [".whl"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
    python3 benchmarks/memory_gpu.py --recipes qwen2_5_1_5b_gsm8k,llama3_2_1b_gsm8k --steps 2 --time-budget 420

Everything stops by --time-budget seconds (default 450, inside one 8-minute device call); what did not
run is listed as skipped. --max-completion-length shortens every run (and its prediction). Without
CUDA the same script is a plumbing smoke test only (fp32, no 4-bit, peak RSS in the CUDA columns):
    python benchmarks/memory_gpu.py --recipes smollm2_135m_gsm8k_cpu --steps 1 --max-completion-length 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `memory_gpu:random_reward` for lowmem_grpo's registry
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PROMPT_OVERHEAD = 5  # <|im_start|> user ... <|im_end|> <|im_start|> assistant
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def random_reward(completions, **kwargs):
    """A reward that varies whatever the model writes, so every step has advantages and a gradient."""
    return [random.random() for _ in completions]


# --- building the model folder and the prompts (worker side) -------------------------------------


def build_tokenizer(vocab_size: int, target: Path):
    """A word-level tokenizer with exactly `vocab_size` tokens ("w<i>", role words, three specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["system", "user", "assistant"] + [f"w{i}" for i in range(vocab_size - 3 - len(SPECIALS))]
    vocab = {word: i for i, word in enumerate(words + SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)
    return fast


def build_model_dir(recipe_name: str, target: Path) -> None:
    """Random bf16 weights of the recipe model's shipped config, built on the GPU and saved to `target`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowmem_grpo.memory.arch import shipped_config_path
    from lowmem_grpo.recipe_io import load_recipe

    if (target / ".complete").exists():
        return
    recipe = load_recipe(recipe_name)
    data = json.loads(shipped_config_path(recipe.model.name).read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(data["vocab_size"], target)
    config = AutoConfig.for_model(**data)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # CPU only for a plumbing smoke run
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    (target / ".complete").write_text(recipe.model.name + "\n")
    del model
    torch.cuda.empty_cache()


def write_rows(path: Path, prompt_len: int, count: int = 64) -> None:
    """GSM8K-shaped rows whose rendered prompt is exactly `prompt_len` tokens."""
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            question = " ".join(f"w{rng.randrange(1000)}" for _ in range(prompt_len - PROMPT_OVERHEAD))
            handle.write(json.dumps({"question": question, "answer": "w1\n#### 1"}) + "\n")


def probe_callback():
    """A TrainerCallback that resets the peak statistics when training starts (the model is loaded)
    and records the peaks, the device's used memory and the trainer's logs (no CUDA: peak RSS)."""
    import resource

    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    class Probe(TrainerCallback):
        def __init__(self):
            self.logs, self.peaks = [], {}

        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.peaks["allocated_at_start"] = torch.cuda.memory_allocated()

        def on_step_end(self, args, state, control, **kwargs):
            if not cuda:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                self.peaks.update(max_allocated=rss, max_reserved=rss, device_used=rss)
                return
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.peaks.update(max_allocated=torch.cuda.max_memory_allocated(),
                              max_reserved=torch.cuda.max_memory_reserved(), device_used=total - free)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return Probe()


def settings_overrides(args: argparse.Namespace, recipe) -> list[str]:
    """The recipe's own settings, with --max-completion-length applied."""
    if not args.max_completion_length:
        return []
    c = args.max_completion_length
    return [f"train.max_completion_length={c}", f"model.max_seq_length={recipe.data.max_prompt_length + c}"]


def run_lowmem(args: argparse.Namespace, model_dir: Path, work: Path):
    import dataclasses

    from lowmem_grpo.recipe import TrainConfig
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = load_recipe(args.recipe)
    rows = work / f"{args.recipe}.jsonl"
    write_rows(rows, recipe.data.max_prompt_length)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = [f"model.name={model_dir}", "model.fast_inference=false", f"data.source={rows}",
                 "data.system_prompt=", "data.prefill=", "rewards.memory_gpu:random_reward=1.0",
                 f"train.max_steps={args.steps}", "train.save_steps=100000", "train.logging_steps=1",
                 f"output.dir={work / ('run-' + args.recipe + '-' + str(time.time_ns()))}"]
    overrides += [f"train.{k}={v}" for k, v in (("preflight.enabled", "false"), ("completions_every", 0),
                                                ("eval.every", 0)) if k.split(".")[0] in fields]
    recipe = apply_overrides(recipe, overrides + settings_overrides(args, recipe))
    probe = probe_callback()
    train(recipe, callbacks=[probe])
    return recipe, probe


def run_plain(args: argparse.Namespace, model_dir: Path, work: Path):
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    from lowmem_grpo.runtime import planned
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    recipe = load_recipe(args.recipe)
    recipe = apply_overrides(recipe, [f"model.name={model_dir}"] + settings_overrides(args, recipe))
    t, lo = recipe.train, recipe.lora
    cuda = torch.cuda.is_available()  # False only in a CPU plumbing smoke run: no 4-bit, fp32, torch log-probs
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if cuda:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16,
                                                     device_map={"": 0})
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=t.gradient_checkpointing)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, bias="none",
                                             task_type="CAUSAL_LM", target_modules=list(lo.target_modules)))
    rows = work / f"{args.recipe}.jsonl"
    write_rows(rows, recipe.data.max_prompt_length)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["question"]}],
                                             tokenize=False, add_generation_prompt=True)
               for line in rows.read_text().splitlines()]
    config = GRPOConfig(
        output_dir=str(work / f"plain-{args.recipe}"), max_steps=args.steps, num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, steps_per_generation=t.steps_per_generation,
        max_completion_length=t.max_completion_length, temperature=t.temperature, learning_rate=t.learning_rate,
        optim=planned(recipe).optimizer if cuda else "adamw_torch",
        gradient_checkpointing=t.gradient_checkpointing, beta=t.beta, bf16=cuda, fp16=False, use_cpu=not cuda,
        logging_steps=1, save_strategy="no", report_to=[], seed=t.seed, disable_tqdm=True)
    probe = probe_callback()
    from lowmem_grpo.train.trainer import CpuSafeGRPOTrainer  # TRL 1.15's log-prob kernel needs a GPU

    trainer_cls = GRPOTrainer if cuda else CpuSafeGRPOTrainer
    trainer = trainer_cls(model=model, reward_funcs=[random_reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tokenizer,
                          callbacks=[probe])
    trainer.train()
    return recipe, probe


def worker(args: argparse.Namespace) -> int:
    """One (recipe, path) in this process: prints one `RESULT {json}` line."""
    work = Path(args.workdir)
    model_dir = work / f"model-{args.recipe}"
    result = {"recipe": args.recipe, "path": args.path}
    started = time.monotonic()
    try:
        build_model_dir(args.recipe, model_dir)
        result["build_s"] = round(time.monotonic() - started, 1)
        run = run_lowmem if args.path == "lowmem" else run_plain
        recipe, probe = run(args, model_dir, work)
        if args.path == "lowmem":
            from lowmem_grpo.backends import start
            from lowmem_grpo.distributed import Launch

            backend = start(recipe, Launch())[0].backend  # what train() ran: unsloth on CUDA when installed
        else:
            backend = "hf"
        result.update(predicted(recipe, backend), backend=backend, **probe.peaks)
        steps = [log for log in probe.logs if "step_time" in log]
        timed = steps[1:] or steps  # the first step also compiles kernels
        tokens = [log.get("completions/mean_length", 0) * recipe.train.generation_batch_size() / log["step_time"]
                  for log in timed if log["step_time"]]
        result.update(steps=len(steps), tokens_per_s=round(sum(tokens) / len(tokens), 1) if tokens else None,
                      step_s=round(sum(log["step_time"] for log in timed) / len(timed), 2) if timed else None)
    except Exception as exc:  # reported in the table; the next run goes on
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def predicted(recipe, backend: str) -> dict:
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides

    p = plan(apply_overrides(recipe, [f"model.backend={backend}"]))
    return {"predicted_allocated": p.allocated_bytes, "predicted_reserved": p.reserved_bytes,
            "predicted_total": p.total_bytes, "peak_phase": p.peak_phase, "terms": p.terms}


# --- the orchestrator ---------------------------------------------------------------------------


def _err(measured, predicted_value) -> str:
    if not measured or predicted_value is None:
        return "-"
    return f"{100 * (predicted_value - measured) / measured:+.1f}%"


def table(results: list[dict]) -> str:
    gib = 2**30
    head = ("recipe", "path", "pred alloc", "max alloc", "err", "pred resv", "max resv", "err", "device used",
            "tok/s", "s/step")
    rows = [head]
    for r in results:
        if "error" in r or "skipped" in r:
            rows.append((r["recipe"], r["path"], r.get("error") or r.get("skipped"), *[""] * 8))
            continue
        rows.append((r["recipe"], r["path"], f"{r['predicted_allocated'] / gib:.2f}", f"{r['max_allocated'] / gib:.2f}",
                     _err(r["max_allocated"], r["predicted_allocated"]), f"{r['predicted_reserved'] / gib:.2f}",
                     f"{r['max_reserved'] / gib:.2f}", _err(r["max_reserved"], r["predicted_reserved"]),
                     f"{r['device_used'] / gib:.2f}", str(r.get("tokens_per_s")), str(r.get("step_s"))))
    widths = [max(len(str(row[i])) for row in rows if len(str(row[2])) < 40 or i != 2) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(widths[i]) if i < 2 else str(c).rjust(widths[i]) for i, c in enumerate(row))
             for row in rows]
    return "\n".join(lines) + ("\n(GiB; err = (predicted - measured) / measured; tok/s = completion tokens per "
                                "second of step time)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="predicted vs measured GPU memory of GRPO steps")
    parser.add_argument("--recipes", help="comma-separated shipped recipe names (default: every GPU recipe)")
    parser.add_argument("--paths", default="lowmem,plain", help="lowmem, plain, or both (default)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (default 3)")
    parser.add_argument("--max-completion-length", type=int, help="override every recipe's completion length")
    parser.add_argument("--time-budget", type=float, default=450, help="seconds for everything (default 450)")
    parser.add_argument("--workdir", default="/tmp/lowmem_memory_gpu", help="models and runs (default /tmp/...)")
    parser.add_argument("--out", help="JSON results file (default: $OUT/memory_gpu.json when $OUT is set)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.update(OFFLINE)
    if args.worker:
        return worker(args)

    from lowmem_grpo.recipe_io import load_recipe, shipped_recipes

    names = args.recipes.split(",") if args.recipes else [p.stem for p in shipped_recipes()
                                                          if load_recipe(str(p)).gpu_memory_gb]
    paths = [p for p in args.paths.split(",") if p in ("lowmem", "plain")]
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_budget
    results = []
    for name in names:
        for path in paths:
            left = deadline - time.monotonic()
            if left < 30:
                results.append({"recipe": name, "path": path, "skipped": "skipped: out of --time-budget"})
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--recipe", name, "--path", path,
                   "--steps", str(args.steps), "--workdir", args.workdir]
            if args.max_completion_length:
                cmd += ["--max-completion-length", str(args.max_completion_length)]
            print(f"== {name} / {path} ({left:.0f} s left)", flush=True)
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=args.workdir)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                result = json.loads(lines[-1][7:]) if lines else {
                    "recipe": name, "path": path, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
            except subprocess.TimeoutExpired:
                result = {"recipe": name, "path": path, "error": "stopped at --time-budget"}
            print(json.dumps({k: v for k, v in result.items() if k != "terms"}), flush=True)
            results.append(result)
    sys.stdout.write(table(results))
    out = args.out or (os.environ["OUT"] + "/memory_gpu.json" if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
