"""What benchmarks/gpu_check.py makes of its measurements: the plan's phases against the peaks, the speed and phase
timings of the logs, and the tables it prints (plain data, one dict per variant). Standard library only."""

from __future__ import annotations

GIB = 2**30
SHARED_PAIR = ("hf-4bit-shared", "hf-4bit-unshared")  # the shared-prompt pass on, off
SHARED_PHASES = ("time/loss_forward", "time/backward")


def predicted_phases(plan_dict: dict) -> dict[str, int]:
    """Allocated bytes the plan predicts for each phase of a run: the resident terms torch counts + the phase."""
    phases, peak = plan_dict["phases"], plan_dict["peak_phase"]
    resident = plan_dict["allocated_bytes"] - phases[peak]
    step = max(phases["generation"], phases["training"])
    return {"grpo": resident + step, "evaluation": resident + phases.get("evaluation", 0),
            "before_grpo": resident + max(step, phases.get("evaluation", 0))}


def evaluation_check(plan_dict: dict, recipe_batch: int | None, used_batch: int | None, peaks: dict) -> dict:
    """The evaluation batch the plan chose, the one the run's recipe.yaml holds and the stage evaluation used, and
    the peak after GRPO (the trained stage evaluation) against the plan's evaluation phase."""
    e = plan_dict.get("evaluation", {})
    predicted = predicted_phases(plan_dict)["evaluation"]
    measured = peaks.get("after_grpo")
    return {"planned_batch": e.get("batch") if e.get("counted") else None, "recipe_batch": recipe_batch,
            "used_batch": used_batch, "eval_kv_bytes": e.get("kv_bytes"), "predicted_eval_allocated": predicted,
            "measured_eval_allocated": measured,
            "batch_agrees": e.get("counted") and e.get("batch") == recipe_batch == used_batch}


def phase_times(logs: list[dict]) -> dict[str, float]:
    """Mean of each `time/<phase>` key over the logged steps after the first (which also compiles kernels)."""
    steps = [log for log in logs if log.get("stage", "grpo") == "grpo" and ("step_time" in log
                                                                          or any(k.startswith("time/") for k in log))]
    timed = steps[1:] or steps
    keys = sorted({k for log in timed for k in log if k.startswith("time/")})
    return {k: round(sum(log[k] for log in timed if k in log) / sum(1 for log in timed if k in log), 3)
            for k in keys}


def speed(logs: list[dict], generation_batch: int) -> dict[str, float | None]:
    """Seconds per step and generated tokens per second: completion tokens of the step over the generation
    phase's time when it is logged (time/generation), else over the whole step."""
    steps = [log for log in logs if log.get("stage", "grpo") == "grpo" and "step_time" in log]
    timed = steps[1:] or steps
    if not timed:
        return {"step_s": None, "tokens_per_s": None}
    rates = []
    for log in timed:
        seconds = log.get("time/generation") or log["step_time"]
        if seconds:
            rates.append(log.get("completions/mean_length", 0) * generation_batch / seconds)
    return {"step_s": round(sum(log["step_time"] for log in timed) / len(timed), 2),
            "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else None}


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def _err(measured, predicted) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def _ratio(on, off) -> str:
    return f"{on / off:.2f}" if isinstance(on, (int, float)) and isinstance(off, (int, float)) and off else "-"


def _columns(rows: list[list[str]], width: int) -> list[str]:
    """Rows of `width` cells aligned (first left, the rest right); other rows as their first cell and reason."""
    widths = [max(len(row[i]) for row in rows if len(row) == width) for i in range(width)]
    lines = []
    for row in rows:
        if len(row) != width:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
            continue
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
    return lines


def table(results: list[dict]) -> str:
    """One row per GRPO variant (and every skipped or failed one); the `time/<phase>` columns any result has."""
    shown = [r for r in results if "error" in r or "skipped" in r or "predicted_allocated" in r]
    phases = sorted({k for r in shown for k in r.get("phases", {})})
    head = ["variant", "steps", "pred alloc", "max alloc", "err", "pred total", "device used", "tok/s", "s/step",
            *phases]
    rows = [head]
    for r in shown:
        if "error" in r or "skipped" in r:
            rows.append([r["variant"], r.get("error") or r.get("skipped")])
            continue
        rows.append([r["variant"], str(r.get("steps", "-")), _gib(r.get("predicted_allocated")),
                     _gib(r.get("max_allocated")), _err(r.get("max_allocated"), r.get("predicted_allocated")),
                     _gib(r.get("predicted_total")), _gib(r.get("device_used")), str(r.get("tokens_per_s") or "-"),
                     str(r.get("step_s") or "-"), *[str(r.get("phases", {}).get(p, "-")) for p in phases]])
    notes = ("(GiB; err = (predicted - measured) / measured; max alloc is GRPO's peak, pred alloc the plan's resident "
             "terms + the step's larger phase; pred total adds what torch does not count: CUDA context, vLLM's pool, "
             "allocator slack; tok/s = generated tokens per second of generation time when time/generation is "
             "logged, else of step time)")
    return "\n".join(_columns(rows, len(head))) + "\n" + notes + "\n"


def evaluation_table(results: list[dict]) -> str:
    """The evaluation batch (planned, in recipe.yaml, used by the stage evaluation) and the peaks around GRPO
    against the plan's phases; empty without such a result."""
    shown = [r for r in results if "evaluation" in r and "error" not in r]
    if not shown:
        return ""
    head = ["variant", "card", "planned", "recipe", "used", "agrees", "eval KV", "pred eval", "after GRPO", "err",
            "pred <=", "before GRPO"]
    rows = [head]
    for r in shown:
        e, p = r["evaluation"], r.get("predicted_phases", {})
        rows.append([r["variant"], f"{r['card_gib']:g}" if r.get("card_gib") else "gpu", str(e.get("planned_batch")),
                     str(e.get("recipe_batch")), str(e.get("used_batch")), "yes" if e.get("batch_agrees") else "NO",
                     _gib(e.get("eval_kv_bytes")), _gib(e.get("predicted_eval_allocated")),
                     _gib(e.get("measured_eval_allocated")),
                     _err(e.get("measured_eval_allocated"), e.get("predicted_eval_allocated")),
                     _gib(p.get("before_grpo")), _gib(r.get("before_grpo"))])
    notes = ("(evaluation batch in sequences: the plan's, the run's recipe.yaml, the stage evaluation's; GiB "
             "allocated: the plan's resident terms + its evaluation phase against the peak from GRPO's end to the "
             "end of the run (the trained adapter's stage evaluation); before GRPO: load, preflight, earlier "
             "stage evaluations, against the plan's larger phase)")
    return "evaluation batch and memory\n" + "\n".join(_columns(rows, len(head))) + "\n" + notes + "\n"


def logits_table(results: list[dict]) -> str:
    """The engine against the model's own generate, per scripted family; empty without that result."""
    found = [r for r in results if "families" in r]
    if not found:
        return ""
    head = ["family", "model", "dtype", "tokens", "forced", "forced n", "lengths", "max diff", "context", "ok"]
    rows = [head]
    for family, f in found[0]["families"].items():
        if "error" in f:
            rows.append([family, f["error"]])
            continue
        rows.append([family, f["model_class"], f["dtype"], "same" if f["tokens_match"] else "DIFFER",
                     "same" if f["forced_match"] else "DIFFER", str(f["forced_tokens"]),
                     "/".join(map(str, f["lengths"])), str(f["max_logit_diff"]), str(f["context_effect"]),
                     "ok" if f["ok"] else "FAIL"])
    tolerance = next((f.get("tolerance") for f in found[0]["families"].values() if "tolerance" in f), None)
    notes = (f"(greedy rows of the scripted prompts, the calculator on; max diff: the largest |engine - generate| "
             f"logit over every token, tolerance {tolerance}; context: how far the first logits move without the "
             f"prompt, which a lost cache would get wrong; lengths: tokens per row, a row of 24 ran out)")
    return "engine against generate\n" + "\n".join(_columns(rows, len(head))) + "\n" + notes + "\n"


def calc_table(results: list[dict]) -> str:
    """The calculator's GRPO steps; empty without that result."""
    found = [r for r in results if "calculator_fired" in r]
    if not found:
        return ""
    r = found[0]
    losses = ", ".join(f"{x:.4g}" for x in r.get("losses", [])) or "-"
    return (f"calculator in GRPO: {r['steps']} steps, the calculator completed {r['calculator_fired']} of "
            f"{r['completions']} recorded rollouts; losses {losses}; peak allocated "
            f"{_gib(r.get('max_allocated'))} GiB\n")


def sharing_table(results: list[dict]) -> str:
    """The shared-prompt pass on vs off (SHARED_PAIR): peak allocated memory, measured and predicted, the loss
    forward, backward and step seconds, and on/off ratios; empty unless both variants ran."""
    by = {r["variant"]: r for r in results if "error" not in r and "skipped" not in r}
    if not all(v in by for v in SHARED_PAIR):
        return ""
    on, off = (by[v] for v in SHARED_PAIR)
    rows = [("", "on", "off", "on/off")]
    rows.append(("max alloc GiB", _gib(on.get("max_allocated")), _gib(off.get("max_allocated")),
                 _ratio(on.get("max_allocated"), off.get("max_allocated"))))
    pred_on, pred_off = on.get("predicted_allocated_shared"), off.get("predicted_allocated_unshared")
    rows.append(("pred alloc GiB", _gib(pred_on), _gib(pred_off), _ratio(pred_on, pred_off)))
    for key in SHARED_PHASES:
        a, b = on.get("phases", {}).get(key), off.get("phases", {}).get(key)
        rows.append((f"{key} s", str(a if a is not None else "-"), str(b if b is not None else "-"), _ratio(a, b)))
    rows.append(("s/step", str(on.get("step_s") or "-"), str(off.get("step_s") or "-"),
                 _ratio(on.get("step_s"), off.get("step_s"))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"shared-prompt pass ({SHARED_PAIR[0]} on, {SHARED_PAIR[1]} off): "
             f"{(on.get('prompt_sharing') or {}).get('reason', '')}"]
    lines += ["  " + "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
              for r in rows]
    return "\n".join(lines) + "\n"


def report(results: list[dict]) -> str:
    """Every table, separated by blank lines."""
    parts = [table(results), evaluation_table(results), logits_table(results), calc_table(results),
             sharing_table(results)]
    return "\n".join(p for p in parts if p)
