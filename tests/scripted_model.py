"""The models the GPU check builds on the machine, none downloaded: a scripted model for checking the sampling engine
against a reference decoder (benchmarks/gpu_check.py on Unsloth, tests/test_gpu_path.py on CPU transformers), and a
shipped recipe's architecture with random weights (`build_model_dir`: the real shapes, so the real memory).

The scripted model is a small decoder of a real family with random layers, orthogonal token embeddings much larger
than what the layers add, and an lm_head that points each token at SCRIPT's next one: SCRIPT's token wins by a wide
margin while attention over the cache still moves every logit measurably. Its word tokenizer splits `<<`, `>>`,
digits and operators, so rows write `<<7*6=` (the calculator forces `42>>`), end at EOS early, or never end.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # pad (and unknown), EOS, turn start
CALC_TOKENS = ["<<", ">>", "=", "+", "-", "*", "/", *"0123456789"]
VOCAB_SIZE = 512
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT_OVERHEAD = 5  # a chat prompt's tokens besides the question: <|im_start|> user, <|im_end|> <|im_start|> assistant
EOS = "<|im_end|>"
SCRIPT = {
    # a chat prompt ends in "assistant": every GRPO row writes a calculation, gets 42>> forced, and ends
    "assistant": "w1", "w1": "<<", "<<": "7", "7": "*", "*": "6", "6": "=", "=": "w60", ">>": "w2", "w2": "w3",
    "w3": EOS,
    "w10": "w11", "w11": "w12", "w12": EOS,  # ends after three tokens
    "w20": "w21", "w21": "w22", "w22": "w21",  # never ends: truncated
    "w30": "<<",  # the calculation, then w2 w3 EOS
    "w40": EOS,  # ends at once
}
PROMPTS = [["w5", "w6", "w10"], ["w7", "w8", "w9", "w20"], ["w40"], ["w13", "w30"], ["w14", "w15", "w16", "w17", "w10"]]
"""Raw prompts (no chat template) of different lengths: left padding, rows that end at different steps, the
calculator firing in one row of the batch."""
CONTEXT_SHARE = 0.6  # what the layers add to the residual stream, relative to the planted embedding
LOGIT_MARGIN = 20.0  # the scripted token's logit, roughly; every other token's is near 0
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", head_dim=64),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=64, sliding_window=512, query_pre_attn_scalar=64,
                        layer_types=["sliding_attention", "full_attention"]),
}


def random_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that varies whatever the model writes, so every step has advantages and a gradient."""
    return [random.random() for _ in completions]


def words(vocab_size: int = VOCAB_SIZE) -> list[str]:
    """The vocabulary in id order: specials, calculator tokens, role words, w0, w1, ..."""
    head = SPECIALS + CALC_TOKENS + ["system", "user", "assistant"]
    return head + [f"w{i}" for i in range(vocab_size - len(head))]


def build_tokenizer(target: Path, vocab_size: int = VOCAB_SIZE):
    """The word tokenizer of `vocab_size` tokens, saved to `target`: `<<`, `>>`, digits and operators split."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"w[0-9]+|<<|>>|[0-9=+*/-]"), behavior="isolated")])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=SPECIALS[0], unk_token=SPECIALS[0],
                                   additional_special_tokens=[SPECIALS[2]])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)
    return fast


def next_token_table() -> dict[int, int]:
    """SCRIPT as token ids; every other word continues with the next unused word (a cycle)."""
    ids = {w: i for i, w in enumerate(words())}
    table = {ids[a]: ids[b] for a, b in SCRIPT.items()}
    used = set(SCRIPT) | set(SCRIPT.values()) | {w for p in PROMPTS for w in p}
    free = [ids[w] for w in words() if w not in used]
    for i, t in enumerate(free):
        table.setdefault(t, free[(i + 1) % len(free)])
    for w in words():  # tokens the script reaches only by force (the calculator's digits, ">>") or in prompts
        table.setdefault(ids[w], free[0])
    return table


def _config(family: str, tokenizer: Any):
    from transformers import AutoConfig

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, hidden_size=VOCAB_SIZE, intermediate_size=1024,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=None, **spec)


def plant(model: Any, context_share: float = CONTEXT_SHARE, seed: int = 0) -> dict[str, float]:
    """Plant the script into `model` (float32, CPU): scaled orthogonal embeddings and next_token_table's lm_head."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
    units = basis[: model.config.vocab_size]  # orthonormal rows: one direction per token
    with torch.no_grad():
        # divided by what the family multiplies embeddings by (Gemma: sqrt(hidden)): the layers see the planted rows
        embed = model.get_input_embeddings()
        embed.weight.copy_(units / float(getattr(embed, "embed_scale", 1.0)))
        added = _layer_contribution(model)  # what the layers add to a unit-norm embedding, on the script's prompts
        scale = added / context_share
        embed.weight.mul_(scale)
        head = torch.zeros_like(model.get_output_embeddings().weight)
        for t, s in next_token_table().items():
            head[s] += units[t] * (LOGIT_MARGIN / hidden ** 0.5)
        model.get_output_embeddings().weight.copy_(head)
    return {"embedding_norm": scale, "layers_added": added}


def _layer_contribution(model: Any) -> float:
    """Mean norm of what the decoder layers add to the residual stream (the final norm's input less the embedding)."""
    import torch

    seen: list[Any] = []
    norm = model.get_decoder().norm
    hook = norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    ids = torch.tensor([[i for i in range(3, 43)]])
    try:
        model(input_ids=ids)
    finally:
        hook.remove()
    embedded = model.get_input_embeddings()(ids)
    return float((seen[0] - embedded).norm(dim=-1).mean())


def build_scripted_model(family: str, target: Path) -> Path:
    """The scripted model of `family` and its tokenizer, saved (bfloat16) to `target`; built on CPU once."""
    import torch
    from transformers import AutoModelForCausalLM

    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, tokenizer), dtype=torch.float32)
    plant(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(target)
    (target / ".complete").write_text(family + "\n")
    return target


def build_model_dir(recipe_name: str, target: Path) -> Path:
    """Random bfloat16 weights of a recipe's shipped model config with a word tokenizer of its vocabulary,
    saved to `target` once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowmem_grpo.memory.arch import shipped_config_path
    from lowmem_grpo.recipe_io import load_recipe

    if (target / ".complete").exists():
        return target
    recipe = load_recipe(recipe_name)
    data = {k: v for k, v in json.loads(shipped_config_path(recipe.model.name).read_text()).items()
            if not k.startswith("_")}
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(target, data["vocab_size"])
    config = AutoConfig.for_model(**data)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(target)
    (target / ".complete").write_text(recipe.model.name + "\n")
    del model
    torch.cuda.empty_cache()
    return target


def write_rows(path: Path, count: int = 32, length: int = 20) -> Path:
    """GSM8K-shaped rows of `length` words: chat prompts ending in "assistant" (the script's calculation)."""
    rng = random.Random(0)
    with path.open("w") as handle:
        for _ in range(count):
            question = " ".join(f"w{rng.randrange(100, 400)}" for _ in range(length))
            handle.write(json.dumps({"question": question, "answer": "w1\n#### 42"}) + "\n")
    return path


# --- the reference: the model's own generate, with the calculator's tokens forced -------------------------------


class CalculatorForcing:
    """A generate() logits processor forcing what the engine's calculator forces after `<<EXPR=`, one
    token a step; `forced[row]` holds the steps it forced."""

    def __init__(self, calculator: Any, prompt_width: int, rows: int) -> None:
        self.calculator = calculator
        self.width = prompt_width
        self.queued: list[list[int]] = [[] for _ in range(rows)]
        self.forced: list[set[int]] = [set() for _ in range(rows)]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        scores = scores.clone()  # generate keeps the tensor it passes in as the step's raw logits (output_logits)
        for row in range(input_ids.shape[0]):
            written = input_ids[row, self.width:].tolist()
            if not self.queued[row] and written:
                self.queued[row] = list(self.calculator.forced_ids(written))
            if self.queued[row]:
                token = self.queued[row].pop(0)
                keep = scores[row, token].clone()
                scores[row].fill_(float("-inf"))
                scores[row, token] = keep
                self.forced[row].add(len(written))
        return scores


class LogitRecorder:
    """Stands in for the model in engine.sample_rows, keeping each call's last-position logits."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        self.calls.append(out.logits[:, -1, :].float().cpu())
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def rows_of_calls(call_sizes: list[int], lengths: list[int]) -> list[list[int]]:
    """Which row each batch position of each engine call holds (the engine drops ended rows);
    ValueError when that does not add up."""
    members = list(range(len(lengths)))
    out = []
    for step, size in enumerate(call_sizes):
        if size != len(members):
            members = [r for r in members if lengths[r] > step]
            if size != len(members):
                raise ValueError(f"call {step} holds {size} rows, {len(members)} are still writing")
        out.append(list(members))
    return out


def engine_logits(calls: list[Any], lengths: list[int]) -> list[list[Any]]:
    """Per row, the engine's logits of each of its generated tokens (the prefill's, then one per decode call)."""
    members = rows_of_calls([c.shape[0] for c in calls], lengths)
    per_row: list[list[Any]] = [[] for _ in lengths]
    for call, rows in zip(calls, members):
        for position, row in enumerate(rows):
            if len(per_row[row]) < lengths[row]:
                per_row[row].append(call[position])
    return per_row


def reference(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """The model's own greedy generate with the calculator's tokens forced: tokens, forced marks, logits."""
    import torch
    from transformers import LogitsProcessorList

    from lowmem_grpo.sampling.engine import Calculator

    width = max(len(r) for r in prompts)  # left-padded
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in prompts])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompts])
    device = next(model.parameters()).device
    forcing = CalculatorForcing(Calculator(tokenizer), ids.shape[1], len(prompts))
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, logits_processor=LogitsProcessorList([forcing]), output_logits=True,
                             return_dict_in_generate=True, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    generated = out.sequences[:, ids.shape[1]:].tolist()
    tokens, forced, logits = [], [], []
    for row, seq in enumerate(generated):
        marks = forcing.forced[row]
        end = next((j + 1 for j, t in enumerate(seq) if t == tokenizer.eos_token_id and j not in marks), len(seq))
        tokens.append(seq[:end])
        forced.append([int(j in marks) for j in range(end)])
        logits.append([out.logits[j][row].float().cpu() for j in range(end)])
    return {"tokens": tokens, "forced": forced, "logits": logits}


def through_engine(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """The engine's greedy rows with the calculator, as evaluation samples them, and their logits."""
    from lowmem_grpo.sampling.engine import Calculator, sample_rows
    from lowmem_grpo.sampling.generate import fast_sampling, inference_mode

    recorder = LogitRecorder(model)
    with inference_mode(model), fast_sampling(model, merged=False):
        rows = sample_rows(recorder, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                           eos_ids={tokenizer.eos_token_id}, pad_id=tokenizer.pad_token_id,
                           calculator=Calculator(tokenizer))
    lengths = [len(r.ids) for r in rows]
    return {"tokens": [r.ids for r in rows], "forced": [r.forced for r in rows],
            "truncated": [r.truncated for r in rows], "logits": engine_logits(recorder.calls, lengths)}


def context_effect(model: Any, prompts: list[list[int]]) -> float:
    """How far the first logits move when each row sees only its last prompt token."""
    import torch

    from lowmem_grpo.sampling.generate import inference_mode

    device = next(model.parameters()).device
    with inference_mode(model), torch.inference_mode():
        full = [model(input_ids=torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
        last = [model(input_ids=torch.tensor([p[-1:]], device=device)).logits[0, -1].float().cpu() for p in prompts]
    return max(float((a - b).abs().max()) for a, b in zip(full, last))


def compare(model: Any, tokenizer: Any, max_new_tokens: int = 24, tolerance: float = 0.5) -> dict[str, Any]:
    """The engine against the model's own generate on the script's prompts; `ok` when tokens and forced tokens
    agree, the calculator fired, rows ended early and ran out, the logits agree within `tolerance` and the context
    moves them by 4 tolerances at least (a lost cache would fail it)."""
    prompts = [tokenizer.convert_tokens_to_ids(p) for p in PROMPTS]
    ref = reference(model, tokenizer, prompts, max_new_tokens)
    eng = through_engine(model, tokenizer, prompts, max_new_tokens)
    diffs = [float((a - b).abs().max()) for ra, rb in zip(eng["logits"], ref["logits"]) for a, b in zip(ra, rb)]
    effect = context_effect(model, prompts)
    lengths = [len(t) for t in eng["tokens"]]
    result = {
        "tokens_match": eng["tokens"] == ref["tokens"], "forced_match": eng["forced"] == ref["forced"],
        "forced_tokens": sum(map(sum, eng["forced"])), "lengths": lengths, "reference_lengths":
        [len(t) for t in ref["tokens"]], "truncated": eng["truncated"],
        "max_logit_diff": round(max(diffs), 4) if diffs else None, "compared_logits": len(diffs),
        "context_effect": round(effect, 4), "tolerance": tolerance,
        "texts": [tokenizer.decode(t, skip_special_tokens=True) for t in eng["tokens"]],
    }
    ended_early = any(not t and n < max_new_tokens for t, n in zip(eng["truncated"], lengths))
    result["ok"] = bool(result["tokens_match"] and result["forced_match"] and result["forced_tokens"] > 0
                        and ended_early and any(eng["truncated"]) and diffs and max(diffs) <= tolerance
                        and effect >= 4 * tolerance)
    return result
