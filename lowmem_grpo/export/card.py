"""The model card (README.md) of an export: what was trained, how, how well, and how to load it."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from lowmem_grpo import __version__
from lowmem_grpo.recipe import resolved_rewards
from lowmem_grpo.recipe_io import dump_yaml
from lowmem_grpo.rundir import export_scores, health, layout, telemetry
from lowmem_grpo.rundir.report import eval_lines, format_value

CARD_FILE = "README.md"
CARD_METRICS = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "loss", "grad_norm", "kl", "step_time"]


NOT_SCORED = ("Not scored: the run has no stage evaluation (train.eval.stage.problems) to pair with, the export is "
              "of a checkpoint, or --no-score was given.")


def _gguf_lines(result: Any) -> list[str]:
    """The llama.cpp proof's figures (gguf_proof.prove_gguf); [] for other formats."""
    g = result.gguf_proof
    if not g:
        return []
    logits = g.get("logits") or {}
    lines = ["", "## Proof in llama.cpp", "",
             f"`{result.file}` ({g.get('bytes', 0) / 2**20:.0f} MiB) reads its tokenizer as "
             f"`{g.get('tokenizer_model')}` / pre `{g.get('tokenizer_pre')}`. It answered the {g.get('problems')} "
             "held-out problems greedily in llama.cpp (llama-cpp-python), and the merged model answered them in "
             "transformers:", "",
             f"- prompts tokenized the same by llama.cpp: {g.get('same_prompt_tokens')} of {g.get('problems')}",
             f"- the same greedy answer text: {g.get('same_greedy_texts')} of {g.get('problems')}",
             f"- logits on {logits.get('positions')} positions (teacher-forced): max |difference| "
             f"{logits.get('max_abs_diff', float('nan')):.3g}, same argmax {logits.get('argmax_agreement', 0):.1%}",
             f"- accuracy: llama.cpp {g.get('accuracy', float('nan')):.3f}, transformers "
             f"{g.get('merged_accuracy', float('nan')):.3f}",
             f"- the file's chat template is the tokenizer's: {'yes' if g.get('chat_template_same') else 'no'}"]
    if g.get("llama_cpp_repack") is False:
        lines.append("- proven with llama.cpp's weight repacking off: this llama.cpp build has AMX kernels, which "
                     "crash on K-quant files; on a CPU with AMX run the file with `--no-repack` (llama-cli, "
                     "llama-server)")
    if "tolerance" in g:
        lines.append(f"- logit tolerance: {g['tolerance']:.3g}")
    if "accuracy_difference" in g:
        d = g["accuracy_difference"]
        lines.append(f"- accuracy, llama.cpp - transformers (paired 95% CI): {d['diff']:+.3f} "
                     f"[{d['low']:+.3f}, {d['high']:+.3f}]")
    if "rule" in g:
        lines.append(f"- the proof's rule for {result.gguf_type}: the file {g['rule']}; it passed")
    if "first_divergence" in g:
        d = g["first_divergence"]
        lines.append(f"- first diverging answer: problem {d['problem']}, token {d['token']}: transformers "
                     f"{d['transformers']!r}, llama.cpp {d['llama.cpp']!r} after {d['before']!r}")
    return lines


def _precision_lines(result: Any) -> list[str]:
    """Which precision the merged weights are in, why, and what each measured precision keeps of the adapter."""
    p = result.precision
    if not p:
        return []
    bound = p["bound"]
    lines = ["", "## Precision", "",
             f"The merged weights are **{p['dtype']}**: {p['reason']}.", "",
             "What each precision keeps of the adapter's change to the merged weights (measured before writing: "
             "kept = <change, delta> / |delta|^2 and error = |change - delta| / |delta| over every LoRA layer, "
             "change = the weight merged in that precision - the base weight in it; within the bound: every layer "
             f"keeps at least {bound['min_kept_per_layer']:.0%} and the error is at most "
             f"{bound['max_error']:.2f}; lowmem_grpo.export.precision):", "",
             "| precision | kept | worst layer | error | within the bound |", "|---|---|---|---|---|"]
    for name, k in p["measured"].items():
        lines.append(f"| {name} | {k['kept']:.1%} | {k['worst_kept']:.1%} (`{k['worst_layer']}`) | {k['error']:.3f} "
                     f"| {'yes' if k['keeps'] else 'no'} |")
    return lines


def _warning_lines(result: Any) -> list[str]:
    return [line for w in result.warnings for line in ("", f"> **Warning:** {w}.")]


def _how_to_load(fmt: str, out: Path, base_name: str, files: list[str], system_prompt: str, prefill: str) -> list[str]:
    here = str(out)
    if fmt == "gguf":
        gguf = next((f for f in files if f.endswith(".gguf")), "model.gguf")
        return ["```bash", f"llama-cli -m {here}/{gguf} -cnv -sys {shlex.quote(system_prompt)}",
                f"llama-server -m {here}/{gguf}", "```", "",
                "Ollama: a `Modelfile` with these lines, then `ollama create my-model -f Modelfile`:", "",
                "```", f"FROM {here}/{gguf}", f'SYSTEM """{system_prompt}"""', "```", "",
                f"The model was trained to answer after the prefill {prefill!r} (the card's recipe, data.prefill); "
                "the file carries the chat template it was trained with."]
    lines = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if fmt == "lora":
        lines += ["from peft import PeftModel", "",
                  f"base = AutoModelForCausalLM.from_pretrained({base_name!r})",
                  f"model = PeftModel.from_pretrained(base, {here!r})"]
    else:
        lines += [f"model = AutoModelForCausalLM.from_pretrained({here!r}, dtype='auto')"]
    lines += [f"tokenizer = AutoTokenizer.from_pretrained({here!r})",
              f"messages = [{{'role': 'system', 'content': {system_prompt!r}}},",
              "            {'role': 'user', 'content': 'A question...'}]",
              f"prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + {prefill!r}",
              "ids = tokenizer(prompt, return_tensors='pt').to(model.device)",
              "print(tokenizer.decode(model.generate(**ids, max_new_tokens=256)[0]))", "```"]
    return lines


def _proof_lines(result: Any) -> list[str]:
    e = result.effect
    lines = ["", "## Export proof", "",
             f"Reloaded with plain transformers (no PEFT, no Unsloth) in {result.dtype} and compared on "
             f"{result.proof_tokens} tokens of fixed prompts with the adapter model in float32:", ""]
    lines += [f"- {name}: max |logit difference| {value:.3g}" for name, value in result.checks.items()]
    lines += [f"- tolerance: {result.tolerance:.3g} (per dtype: the larger of a floor and a share of the largest "
              "|logit|; lowmem_grpo.export.proof.TOLERANCES)",
              f"- the adapter itself moves the base model's logits by up to {format_value(result.adapter_effect)}"]
    if e and not math.isnan(e["error"]):  # nan: the adapter has no effect to carry
        lines.append(f"- the adapter's effect on the logits, as the export carries it (beside the base model in "
                     f"{result.dtype}): kept {e['kept']:.1%}, error {e['error']:.3f} of the effect (at most "
                     f"{e['max_error']:.2f}; an export that lost the adapter has 1.00)")
    return lines


def write_card(folder: Path, run_dir: Path, recipe: Any, result: Any, base_name: str, base_path: str) -> None:
    """Write README.md into the export folder (listing the files already there)."""
    files = sorted({p.name for p in folder.iterdir() if not p.name.startswith(".")} | {CARD_FILE})
    records = telemetry.read_metrics(run_dir)
    steps = [r for r in health.training_records(records) if result.step is None or int(r.get("step", 0)) <= result.step]
    last = steps[-1] if steps else None  # the last training record at or before the exported step
    summary = next((r for r in reversed(records) if "train_runtime" in r), None)
    title = result.format + (f", {result.dtype}" if result.dtype else "")
    lines = [f"# {recipe.name} ({title})", *_warning_lines(result), "",
             f"A LoRA adapter trained with GRPO by lowmem_grpo {__version__}"
             + ("." if result.format == "lora" else ", merged into its base model."), "",
             "| | |", "|---|---|",
             f"| base model | `{base_name}` (loaded from `{base_path}`) |",
             f"| recipe | `{recipe.name}`: {recipe.description or '-'} |",
             f"| task | {recipe.task} |",
             f"| training steps | {format_value(result.step)} of {recipe.train.max_steps} |",
             f"| LoRA | r={recipe.lora.r}, alpha={recipe.lora.alpha}, modules {', '.join(recipe.lora.target_modules)} |",
             f"| exported from | `{result.source}` |", "",
             "## Rewards", "", "| reward | weight |", "|---|---|"]
    lines += [f"| {name} | {format_value(weight)} |" for name, weight in resolved_rewards(recipe).items()]
    lines += ["", "## Final training metrics", ""]
    if last:
        lines += [f"At step {last.get('step')} (from {layout.METRICS_FILE}):", "", "| metric | value |", "|---|---|"]
        keys = CARD_METRICS[:1] + sorted(k for k in last if k.startswith("rewards/") and k.endswith("/mean")) \
            + CARD_METRICS[1:]
        lines += [f"| {k} | {format_value(last[k])} |" for k in keys if k in last]
        if summary and (result.step is None or summary.get("step") == result.step):
            lines += [f"| train_runtime (s) | {format_value(summary.get('train_runtime'))} |"]
    else:
        lines.append(f"No training metrics in {layout.METRICS_FILE}.")
    lines += ["", "## Evaluation", ""]
    lines += eval_lines(run_dir) or [f"Not evaluated (no {layout.EVAL_FILE} in the run directory or its eval/)."]
    if result.format != "lora":
        lines += _precision_lines(result) + _proof_lines(result)
    lines += _gguf_lines(result)
    lines += ["", "## Accuracy on the task", ""]
    lines += export_scores.table_lines([{"out": str(result.out), "format": result.format, "file": result.file,
                                         "score": result.score}]) or [NOT_SCORED]
    lines += ["", "## How to load", ""]
    lines += _how_to_load(result.format, result.out, base_name, files, recipe.data.system_prompt, recipe.data.prefill)
    lines += ["", "## Files", ""] + [f"- `{f}`" for f in files]
    lines += ["", "## Recipe", "", "```yaml", dump_yaml(recipe).rstrip(), "```", ""]
    (folder / CARD_FILE).write_text("\n".join(lines), encoding="utf-8")
