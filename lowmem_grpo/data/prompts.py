"""GSM8K rows as prompts: system prompt + question, rendered to text with the model's chat template (docs/data.md),
so an assistant prefill can follow the generation prompt, and the `max_prompt_length` rule applied here (TRL 1.x
never truncates prompts)."""

from __future__ import annotations

import logging
from typing import Any

from lowmem_grpo.data.generated import level_of, level_shares
from lowmem_grpo.errors import DataError
from lowmem_grpo.rewards.parsing import gold_number

log = logging.getLogger(__name__)


def render_prompt(tokenizer: Any, question: str, system_prompt: str, prefill: str = "") -> str:
    """Chat-template text that generation continues from, with the prefill appended; a leading BOS is dropped from
    the text when the tokenizer adds one itself (no prompt tokenized with two)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        ids = tokenizer("x")["input_ids"]
        if ids and ids[0] == tokenizer.bos_token_id:
            text = text[len(bos):]
    return text + prefill


def prompt_length(tokenizer: Any, text: str) -> int:
    """Tokens in a rendered prompt, counted the way TRL tokenizes it."""
    return len(tokenizer(text)["input_ids"])


def _truncate_question(tokenizer: Any, question: str, system_prompt: str, prefill: str, limit: int) -> str | None:
    """Cut the question from the left until the prompt fits; None when even an empty question does not."""
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    overhead = prompt_length(tokenizer, render_prompt(tokenizer, "", system_prompt, prefill))
    keep = limit - overhead
    while keep > 0:
        cut = tokenizer.decode(ids[-keep:], skip_special_tokens=True).lstrip()
        text = render_prompt(tokenizer, cut, system_prompt, prefill)
        if prompt_length(tokenizer, text) <= limit:
            return text
        keep -= 1
    return None


def build_examples(rows: list[dict[str, str]], tokenizer: Any, system_prompt: str, prefill: str,
                   max_prompt_length: int, long_prompts: str = "filter") -> list[dict[str, Any]]:
    """Examples with `prompt` (rendered text), `answer` (gold number), `question`, `solution`, `prefill`; DataError
    when no prompt fits `max_prompt_length`."""
    examples, dropped, truncated = [], 0, 0
    for row in rows:
        text: str | None = render_prompt(tokenizer, row["question"], system_prompt, prefill)
        if prompt_length(tokenizer, text) > max_prompt_length:
            text = (_truncate_question(tokenizer, row["question"], system_prompt, prefill, max_prompt_length)
                    if long_prompts == "truncate" else None)
            truncated += text is not None
            if text is None:
                dropped += 1
                continue
        examples.append({"prompt": text, "answer": gold_number(row["answer"]), "question": row["question"],
                         "solution": row["answer"], "prefill": prefill})
    if dropped or truncated:
        log.info("prompt length rule (max %d tokens): %d dropped, %d truncated, %d kept",
                 max_prompt_length, dropped, truncated, len(examples))
    if not examples:
        raise DataError(
            f"no prompt fits data.max_prompt_length={max_prompt_length} tokens ({dropped} of {len(rows)} too long)",
            fix="raise data.max_prompt_length (and model.max_seq_length), or use data.long_prompts=truncate")
    return examples


def recipe_examples(rows: list[dict[str, str]], tokenizer: Any, data: Any) -> list[dict[str, Any]]:
    """`build_examples` with the prompt settings of a recipe's data section."""
    return build_examples(rows, tokenizer, data.system_prompt, data.prefill, data.max_prompt_length, data.long_prompts)


def grpo_examples(examples: list[dict[str, Any]], data: Any) -> list[dict[str, Any]]:
    """The examples GRPO draws from: those of data.generated.grpo_levels in the shares it names ("1,2,2,2": a quarter
    one-step, three quarters two-step; the most examples that keep those shares, in their order), else all."""
    spec = data.generated.grpo_levels  # validate refuses it unless data.source=generated
    if spec is None:
        return examples
    shares = level_shares(spec)
    levels = [level_of(ex["question"], ex["solution"]) for ex in examples]
    found = {lv: levels.count(lv) for lv in shares}
    missing = [str(lv) for lv, n in found.items() if not n]
    if missing:
        raise DataError(f"no training problem of data.generated.grpo_levels={spec} among {len(examples)}: none of "
                        f"level {', '.join(missing)}",
                        fix="name levels that data.generated.levels draws, or raise data.generated.train_size")
    # the largest mix in which no level asks for more examples than it has
    size = min(found[lv] / share for lv, share in shares.items())
    quota = {lv: int(size * share + 1e-9) for lv, share in shares.items()}
    chosen = []
    for ex, lv in zip(examples, levels):
        if quota.get(lv, 0) > 0:
            chosen.append(ex)
            quota[lv] -= 1
    log.info("GRPO draws from %d of %d training problems (data.generated.grpo_levels=%s)", len(chosen),
             len(examples), spec)
    return chosen
