"""An export's score on the held-out problems: the paired arithmetic, the stage evaluation it pairs with, and the
run's export_scores.json / report section."""

from __future__ import annotations

import json

from lowmem_grpo.evaluation.metrics import Verdict
from lowmem_grpo.export.score import significantly_worse, stage_reference, summarize
from lowmem_grpo.rundir import export_scores, layout


def verdicts(correct: list[int]) -> list[list[Verdict]]:
    return [[Verdict(completion="x", extracted_answer=None, last_number=None, strict_correct=bool(c),
                     lenient_correct=bool(c), strict_format=True, soft_format=True, truncated=False,
                     completion_tokens=3)] for c in correct]


def test_summary_pairs_the_export_with_the_adapter_and_the_base():
    adapter, export, base = [1, 1, 0, 0, 1, 1, 0, 1], [1, 0, 0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 1, 0, 0, 0]
    s = summarize(verdicts(export), {"trained": verdicts(adapter), "base": verdicts(base)})
    assert s["problems"] == 8 and s["export"]["mean"] == 0.5 and s["adapter"]["mean"] == 0.625
    assert s["minus_adapter"]["diff"] == -0.125 and s["minus_base"]["diff"] == 0.375
    assert s["adapter_minus_base"]["diff"] == 0.5
    for key in ("minus_adapter", "minus_base", "adapter_minus_base"):
        assert s[key]["low"] <= s[key]["diff"] <= s[key]["high"]
    # one problem lost of eight, paired: the CI reaches zero from below, it cannot lie wholly above it
    assert s["minus_adapter"]["low"] < 0 <= s["minus_adapter"]["high"]
    alone = summarize(verdicts(export), {})
    assert "adapter" not in alone and "minus_adapter" not in alone and alone["export"]["mean"] == 0.5


def test_significantly_worse_only_when_the_paired_ci_is_below_zero():
    assert significantly_worse(verdicts([1] * 20), verdicts([1] * 20)) is None
    assert significantly_worse(verdicts([1] * 20), verdicts([1] * 19 + [0])) is None
    worse = significantly_worse(verdicts([1] * 20), verdicts([0] * 20))
    assert worse is not None and worse["diff"] == -1.0 and worse["high"] < 0


def test_stage_reference_is_the_final_adapters_answers_on_the_same_problems(tmp_path):
    dump = lambda c: [[v.__dict__ for v in p] for p in verdicts(c)]  # noqa: E731
    (tmp_path / layout.STAGE_EVAL_FILE).write_text(json.dumps(
        {"verdicts": {"base": dump([0, 0, 1]), "primed": dump([0, 1, 1]), "trained": dump([1, 1, 1])}}))
    found = stage_reference(tmp_path, 3, final=True)
    assert sorted(found) == ["base", "trained"] and [v[0].strict_correct for v in found["trained"]] == [1, 1, 1]
    assert stage_reference(tmp_path, 3, final=False) == {}  # a checkpoint is not the adapter the stage eval scored
    assert stage_reference(tmp_path, 4, final=True) == {}  # other problems
    assert stage_reference(tmp_path / "nowhere", 3, final=True) == {}


def test_export_scores_replace_per_folder_and_render_the_report_section(tmp_path):
    score = summarize(verdicts([1, 0, 1, 1]), {"trained": verdicts([1, 1, 1, 1]), "base": verdicts([0, 0, 0, 1])})
    export_scores.record(tmp_path, {"out": "/x/gguf", "format": "gguf q4_k_m", "file": "m-Q4_K_M.gguf", "score": score})
    export_scores.record(tmp_path, {"out": "/x/merged", "format": "merged-16bit", "file": None, "score": score})
    export_scores.record(tmp_path, {"out": "/x/gguf", "format": "gguf f16", "file": "m-F16.gguf", "score": score})
    entries = export_scores.read(tmp_path)
    assert [e["format"] for e in entries] == ["merged-16bit", "gguf f16"]
    lines = export_scores.report_lines(tmp_path)
    assert lines[0] == "## The gain survives export"
    text = "\n".join(lines)
    assert "| adapter (stage_eval.json) | 1.000 [1.000, 1.000] | - | +0.750" in text
    assert "| gguf f16 `m-F16.gguf` | 0.750" in text and "| merged-16bit `merged` | 0.750" in text
    assert "-0.250 [" in text
    assert export_scores.report_lines(tmp_path / "none") == []
