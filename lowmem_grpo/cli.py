"""The `lowmem-grpo` command: argument parsing and exit codes only; each command calls one function.
Exit codes: 0 success, 1 failure while running, 2 bad input (usage, recipe, data), 3 no reward signal."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo import DEFAULT_RECIPE
from lowmem_grpo.errors import EXIT_FAILURE, EXIT_NO_SIGNAL, EXIT_OK, BadInputError, LowmemError
from lowmem_grpo.recipe_io import dump_yaml, explicit_keys, load_recipe, shipped_recipes

log = logging.getLogger("lowmem_grpo")


# Third-party start-up lines that say nothing to a user of this tool, by logger name (only these messages).
KNOWN_NOISE = {
    # torchao registers enums with torch's pytree at import; torch 2.14 deprecates that, one line per enum
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    # bitsandbytes on an avx512_bf16 CPU tries the `kernels` hub package, which is not installed (nor needed)
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


def _not_known_noise(record: logging.LogRecord) -> bool:
    return not any(fragment in record.getMessage() for fragment in KNOWN_NOISE.get(record.name, ()))


def _setup_logging(verbose: bool) -> None:
    for name in KNOWN_NOISE:  # before anything heavy is imported: the first screen a user sees is ours
        logging.getLogger(name).addFilter(_not_known_noise)  # added once: addFilter skips a filter it has
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def cmd_train(args: argparse.Namespace) -> int:
    from lowmem_grpo.errors import ResumeAfterOom
    from lowmem_grpo.rundir import checkpoints, layout
    from lowmem_grpo.train.pipeline import train
    from lowmem_grpo.train.resilience import resume_in_fresh_process

    try:
        if args.resume:  # the run's own recipe.yaml; each stage skips what the run directory holds
            recipe = load_recipe(str(checkpoints.resume_recipe_path(args.resume, args.recipe, args.overrides)))
            run_dir = train(recipe, resume_dir=args.resume, callbacks=args.callbacks)
        elif args.recipe is None:
            raise BadInputError("train needs a RECIPE, or --resume RUN_DIR",
                                fix=f"e.g. lowmem-grpo train {DEFAULT_RECIPE} (the CPU default, what `make demo` runs)")
        else:
            run_dir = train(load_recipe(args.recipe, args.overrides), explicit=explicit_keys(args.overrides),
                            callbacks=args.callbacks)
    except ResumeAfterOom as exc:  # the lowered settings are in the run's recipe.yaml
        log.warning("%s", str(exc).split("\n")[0])
        resume_in_fresh_process(exc.run_dir, verbose=args.verbose)
    log.info("done: adapter in %s", Path(run_dir) / layout.ADAPTER_DIR)
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from lowmem_grpo import distributed
    from lowmem_grpo.backends import locate_model, on_hub, prepare
    from lowmem_grpo.combinations import check
    from lowmem_grpo.data import source_exists
    from lowmem_grpo.data.budget import check_recipe_budget
    from lowmem_grpo.runtime import before_cuda, place, resolve

    recipe = load_recipe(args.recipe, args.overrides)
    environ = distributed.launcher_environment(args.accelerate_config) if args.accelerate_config else None
    launch, facts = distributed.launch(recipe.train.extra, environ), before_cuda(recipe)
    placed = place(recipe, launch, facts)
    check(recipe, placed)  # what `train` checks before any model loads, where it would place the run
    target = resolve(recipe, launch, facts)
    if not source_exists(recipe.data.source):
        raise BadInputError(f"data.source {recipe.data.source!r}: no such file or folder",
                            fix="give an existing path, or use hub or embedded")
    check_recipe_budget(recipe, lambda: locate_model(recipe.model.name), hub_model=on_hub(recipe.model.name))
    if args.trainer_fields and recipe.train.extra:  # only extra train keys need TRL's GRPOConfig (and its imports)
        prepare(target.backend)  # trl is imported next: Unsloth first when it is the backend
        from lowmem_grpo.train.grpo import check_trainer_fields

        check_trainer_fields(recipe)
    sys.stdout.write(dump_yaml(recipe) if args.show else
                     f"ok: {args.recipe} ({recipe.name}; {target.describe()})\n{target.block(recipe)}")
    return EXIT_OK


def cmd_recipes(args: argparse.Namespace) -> int:
    rows = [("recipe", "model", "task", "GPU memory", "description")]
    for path in shipped_recipes():
        recipe = load_recipe(str(path))
        gpu = f"{recipe.gpu_memory_gb} GB" if recipe.gpu_memory_gb else "CPU"
        rows.append((path.stem, recipe.model.name, recipe.task, gpu, recipe.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        sys.stdout.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] + "\n")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from lowmem_grpo.doctor import report

    text, problems = report()
    sys.stdout.write(text)
    return EXIT_FAILURE if problems else EXIT_OK


def _unescape(text: str | None) -> str | None:
    """`\\n` and `\\t` typed on the command line become a newline and a tab."""
    return None if text is None else text.replace("\\n", "\n").replace("\\t", "\t")


def cmd_eval(args: argparse.Namespace) -> int:
    from lowmem_grpo.evaluation.command import EvalOptions, render, run

    opts = EvalOptions(model=args.model, adapter=args.adapter, recipe=args.recipe, data=args.data, split=args.split,
                       limit=args.limit, batch_size=args.batch_size, seed=args.seed, samples=args.samples,
                       temperature=args.temperature, max_new_tokens=args.max_new_tokens, out=args.out,
                       compare=args.compare, prefill=_unescape(args.prefill),
                       system_prompt=_unescape(args.system_prompt), engine=args.engine, progress=not args.no_progress,
                       overrides=tuple(args.overrides))
    sys.stdout.write(render(run(opts)))
    return EXIT_OK


def cmd_check_rewards(args: argparse.Namespace) -> int:
    from lowmem_grpo.train.preflight import check_rewards, render

    recipe = load_recipe(args.recipe, args.overrides)
    result = check_rewards(recipe, recipe.train.preflight.prompts if args.prompts is None else args.prompts)
    sys.stdout.write(render(result, recipe))
    return EXIT_NO_SIGNAL if result.no_signal else EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from lowmem_grpo.export.formats import export

    result = export(args.run_dir, args.format, args.out, checkpoint=args.checkpoint, overwrite=args.overwrite,
                    dtype=args.dtype, tolerance=args.tolerance, llama_cpp=args.llama_cpp, base=args.base,
                    gguf_type=args.gguf_type, score=not args.no_score)
    proof = "" if result.max_abs_diff is None else (
        f", max |logit diff| {result.max_abs_diff:.3g} <= {result.tolerance:.3g} ({result.dtype})")
    sys.stdout.write(f"exported {result.format} to {result.out} in {result.seconds:.1f} s{proof}\n")
    if result.precision:
        kept = result.precision["measured"][result.dtype]
        effect = result.effect
        sys.stdout.write(f"precision {result.dtype}: keeps {kept['kept']:.1%} of the adapter's change to the weights "
                         f"(error {kept['error']:.3f}); its logits keep {effect['kept']:.1%} of the adapter's effect "
                         f"(error {effect['error']:.3f}, at most {effect['max_error']:.2f})\n")
    for warning in result.warnings:
        sys.stdout.write(f"WARNING: {warning}\n")
    g = result.gguf_proof
    if g:
        sys.stdout.write(f"{result.file}: {g['bytes'] / 2**20:.0f} MiB, tokenizer {g['tokenizer_model']} / "
                         f"{g['tokenizer_pre']}; in llama.cpp {g['same_greedy_texts']} of {g['problems']} greedy "
                         f"answers as in transformers, max |logit diff| {g['logits']['max_abs_diff']:.3g}\n")
        d = g.get("accuracy_difference")
        paired = "" if d is None else (f"; its accuracy - the merged model's {d['diff']:+.3f} "
                                       f"[{d['low']:+.3f}, {d['high']:+.3f}]")
        sys.stdout.write(f"proof passed: a {result.gguf_type} file {g.get('rule', '')}{paired}\n")
    if result.score:
        from lowmem_grpo.export.score import line

        sys.stdout.write(f"accuracy: {line(result.score)}\n")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from lowmem_grpo.rundir.report import write_report

    sys.stdout.write(f"{write_report(args.run_dir)}\n")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from lowmem_grpo.memory.fit import plan_with_proposal
    from lowmem_grpo.memory.plan import default_budget, format_plan, parse_size
    from lowmem_grpo.recipe_rules import validate
    from lowmem_grpo.runtime import planned

    recipe = load_recipe(args.recipe, args.overrides)
    validate(recipe)
    budget = parse_size(args.gpu_memory) if args.gpu_memory else default_budget(recipe)
    result = plan_with_proposal(recipe, budget)
    sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n" if args.json else
                     planned(recipe).block(recipe) + format_plan(result, recipe.name))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(prog="lowmem-grpo", description="GRPO on one small GPU, in the least memory.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    overrides_help = "key.sub=value overrides, e.g. train.max_steps=10 model.backend=hf"

    p = sub.add_parser("train", help="train a recipe (.py module or recipe.yaml)")
    p.add_argument("recipe", nargs="?", help="recipes/NAME.py, a shipped recipe name, or RUN_DIR/recipe.yaml")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its last complete checkpoint, with its own recipe.yaml")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("validate", help="check a recipe without loading a model")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--show", action="store_true", help="print the resolved recipe as YAML")
    p.add_argument("--no-trainer-fields", dest="trainer_fields", action="store_false",
                   help="skip checking extra train keys against TRL's GRPOConfig (which imports trl)")
    p.add_argument("--accelerate-config", metavar="FILE", help="check the recipe as `accelerate launch --config_file "
                   "FILE` would run it (its processes and DeepSpeed ZeRO stage), e.g. recipes/accelerate/zero2.yaml; "
                   "default: this process's launcher")
    p.set_defaults(func=cmd_validate)

    sub.add_parser("recipes", help="list the shipped recipes").set_defaults(func=cmd_recipes)
    sub.add_parser("doctor", help="print the environment and known-bad combinations").set_defaults(func=cmd_doctor)

    p = sub.add_parser("eval", help="GSM8K accuracy and format rates of a model, adapter or run (--compare: base vs "
                       "adapter)")
    p.add_argument("--model", required=True, help="hub id, local folder, embedded:NAME, or a run directory")
    p.add_argument("--adapter", help="adapter folder or run directory (default: the run directory's adapter/)")
    p.add_argument("--recipe", help="recipe whose prompts and model settings to use (default: the run's recipe.yaml)")
    p.add_argument("--data", help="gsm8k, embedded, or a .jsonl/.json/.parquet/.csv path (default: the recipe's)")
    p.add_argument("--split", help="split to evaluate (default: the recipe's data.eval_split, test)")
    p.add_argument("--limit", type=int, help="evaluate the first N problems")
    p.add_argument("--batch-size", type=int, default=8, help="sequences generated at once (default 8)")
    p.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed (default 0)")
    p.add_argument("--samples", type=int, default=1, help="completions per problem; >1 adds pass@k and mean@k")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--max-new-tokens", type=int, help="default: the recipe's train.max_completion_length")
    p.add_argument("--out", help="output folder (default: RUN_DIR/eval/SPLIT-TIME or evals/MODEL-TIME)")
    p.add_argument("--compare", action="store_true", help="base model vs adapter on the same problems, with 95%% CIs")
    p.add_argument("--prefill", help="assistant-turn prefill, e.g. '<reasoning>\\n' (\\n is a newline)")
    p.add_argument("--system-prompt", help="system prompt (default: the recipe's)")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                   help="auto = vLLM when installed with CUDA, else transformers generate")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*",
                   help="key.sub=value recipe overrides, e.g. data.generated.eval_stories=heldout")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("check-rewards", help="reward preflight: would GRPO get a signal? (exit 3 if not); never trains")
    p.add_argument("recipe", help="recipes/NAME.py, a shipped recipe name, or RUN_DIR/recipe.yaml")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--prompts", type=int, help="prompt groups to sample (default: train.preflight.prompts, 16)")
    p.set_defaults(func=cmd_check_rewards)

    p = sub.add_parser("export", help="export a run's adapter: merged (default), merged-16bit, lora or gguf (proven, "
                       "and scored on the run's held-out problems)")
    p.add_argument("run_dir", help="the run directory `train` wrote")
    p.add_argument("--format", default="merged", help="merged (default): the adapter merged into its base, in the "
                   "smallest precision that keeps the adapter's change (bfloat16, float16 or float32, measured on the "
                   "weights; the card says which); merged-16bit: the same in bfloat16 or float16 only, refused when "
                   "neither keeps it; lora: the adapter alone; gguf: a llama.cpp file")
    p.add_argument("--out", required=True, help="output folder (must be empty or absent unless --overwrite)")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="export checkpoint-STEP instead of the final adapter")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out (only once the export succeeded)")
    p.add_argument("--dtype", help="precision of the merged weights: float32, bfloat16 or float16 (default: the "
                   "smallest that keeps this adapter's change, measured before writing, on every machine)")
    p.add_argument("--tolerance", type=float, help="max |logit diff| from the float32 adapter model allowed (default: "
                   "max(floor, share x max |logit|) per dtype: float32 1e-4 / 1e-5, float16 1e-2 / 2e-2, bfloat16 "
                   "5e-2 / 0.1). With it, an export whose logits do not keep the adapter's effect is published, "
                   "with a warning in the log and its card")
    p.add_argument("--gguf-type", default="auto", help="--format gguf: auto (default: f16, bf16 or f32, the precision "
                   "that keeps the adapter), f16, bf16 or f32 (proven by greedy texts / logits), q8_0 or q4_k_m "
                   "(llama.cpp's quantization, proven by accuracy)")
    p.add_argument("--llama-cpp", metavar="DIR", help="--format gguf: a llama.cpp folder whose convert_hf_to_gguf.py "
                   "to use, or llama-cpp-python's source distribution file (default: $LLAMA_CPP_DIR, else the "
                   "converter of the installed llama-cpp-python, fetched on first use)")
    p.add_argument("--no-score", action="store_true", help="skip answering the run's held-out problems with a merged "
                   "export (a gguf export answers them for its proof)")
    p.add_argument("--base", help="base model to merge into (default: the recipe's model.name)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="write plots/*.png and report.md for a run (also mid-run)")
    p.add_argument("run_dir", help="the run directory `train` writes")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("plan", help="predicted peak GPU memory of a recipe, term by term, and the settings that fit")
    p.add_argument("recipe", help="recipes/NAME.py, a shipped recipe name, or RUN_DIR/recipe.yaml")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--gpu-memory", metavar="SIZE", help="budget, e.g. 8GiB, 12GB, 24G (default: the recipe's "
                   "gpu_memory_gb, else the visible GPU's memory)")
    p.add_argument("--json", action="store_true", help="one JSON object: total_bytes, fits, terms, proposal, ...")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None, *, callbacks: Sequence[Any] = ()) -> int:
    """Run one command; returns its exit code. `callbacks`: extra TrainerCallbacks for `train` (a Python seam)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    args.callbacks = list(callbacks)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except LowmemError as exc:  # bad input (BadInputError) exits 2
        log.error("%s", exc)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        log.error("interrupted")
        return getattr(exc, "exit_code", 130)  # a second SIGTERM (lowmem_grpo.errors.Aborted): 143


def main_for_recipe(recipe_file: str) -> int:
    """`python recipes/NAME.py [overrides]`: train that recipe."""
    return main(["train", recipe_file, *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
