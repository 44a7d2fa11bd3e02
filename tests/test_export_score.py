"""An export's score on the held-out problems: the paired arithmetic, the stage evaluation it pairs with, and the
run's export_scores.json / report section."""

from __future__ import annotations

import json

from lowmem_grpo.evaluation.metrics import Verdict
from lowmem_grpo.export.score import difference, significantly_worse, stage_reference, summarize
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


def test_significantly_worse_only_when_the_paired_ci_is_below_minus_the_margin():
    same, one_lost = difference(verdicts([1] * 20), verdicts([1] * 20)), difference(verdicts([1] * 20),
                                                                                    verdicts([1] * 19 + [0]))
    assert not significantly_worse(same) and not significantly_worse(one_lost)
    collapsed = difference(verdicts([1] * 20), verdicts([0] * 20))
    assert collapsed["diff"] == -1.0 and significantly_worse(collapsed) and significantly_worse(collapsed, 0.5)
    assert not significantly_worse(collapsed, 1.0)


def q8_like(lost: int, correct: int = 78, problems: int = 100) -> tuple[list[list[Verdict]], list[list[Verdict]]]:
    """The merged model right on `correct` of `problems`; the file loses `lost` of those and gains none."""
    merged = [1] * correct + [0] * (problems - correct)
    return verdicts(merged), verdicts([0] * lost + merged[lost:])


def test_a_quantized_file_that_flips_a_few_answers_passes_its_proof():
    from lowmem_grpo.export.gguf_proof import judge_quantized

    merged, export = q8_like(lost=4)
    figures, failure = judge_quantized("q8_0", merged, export)
    d = figures["accuracy_difference"]
    assert failure is None and d["diff"] == -0.04 and d["high"] < 0  # significant at zero, not beyond the margin
    assert figures["margin"] == 0.05 and "-0.05" in figures["rule"]
    assert judge_quantized("q4_k_m", *q8_like(lost=12))[1] is None  # -0.12 [-0.19, -0.06]: within q4_k_m's 0.10


def test_a_collapsed_or_clearly_worse_quantized_file_fails_its_proof():
    from lowmem_grpo.export.gguf_proof import judge_quantized

    for gguf_type in ("q8_0", "q4_k_m"):
        figures, failure = judge_quantized(gguf_type, *q8_like(lost=78))  # word salad: nothing right
        assert failure is not None and "significantly more than" in failure
        assert figures["accuracy_difference"]["diff"] == -0.78
        assert judge_quantized(gguf_type, *q8_like(lost=20))[1] is not None  # -0.20 [-0.28, -0.13]
    _, failure = judge_quantized("q8_0", *q8_like(lost=12))  # -0.12 [-0.19, -0.06]: beyond q8_0's 0.05
    assert failure is not None and "-0.120" in failure


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
