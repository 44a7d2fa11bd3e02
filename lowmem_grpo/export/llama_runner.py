"""`python -m lowmem_grpo.export.llama_runner REQUEST.json`: one llama.cpp job (generate, logits, quantize) in a
child process, its answer written to the request's `result` path; llama.cpp aborts the process on some broken files,
so gguf_proof.run_child reads a crash as a failed proof."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
AMX_KERNELS = "AMX_INT8 = 1"
"""What llama.cpp's system info lists when it was built with its AMX kernels (llama-cpp-python compiles llama.cpp for
the installing CPU, so on an Intel CPU with AMX)."""


def amx_kernels(system_info: str) -> bool:
    """Whether this llama.cpp build runs quantized weights through its AMX kernels: they repack q4_0/q4_1/q8_0 and the
    k-quants into AMX tiles at load, and on K-quant files (Q4_K_M) they crash llama.cpp with SIGSEGV in
    ggml_backend_amx_mul_mat, a llama.cpp bug that depends on the machine."""
    return AMX_KERNELS in system_info


def repack_allowed(job: dict[str, Any]) -> bool:
    """The job's `repack` (true/false), or by default on unless this build has AMX kernels: the proof then runs the
    file on llama.cpp's plain CPU kernels, the same weights without the crashing repacked path."""
    if job.get("repack") is not None:
        return bool(job["repack"])
    import llama_cpp

    return not amx_kernels(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))


def _load(model: str, n_ctx: int, logits_all: bool = False, repack: bool = True) -> Any:
    """The file in llama.cpp; `repack=False` loads it with no extra buffer types (llama-cli's --no-repack)."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    threads = max(1, os.cpu_count() or 1)  # llama-cpp-python's default is half the cores
    defaults = bindings.llama_model_default_params
    if not repack:  # Llama takes its model parameters from this function and has no argument for this one
        bindings.llama_model_default_params = lambda: _no_extra_buffers(defaults())
    try:
        return Llama(model_path=model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=logits_all, verbose=False,
                     seed=0, n_threads=threads, n_threads_batch=threads)
    finally:
        bindings.llama_model_default_params = defaults


def _no_extra_buffers(params: Any) -> Any:
    params.use_extra_bufts = False
    return params


def _forced(llm: Any, completion: list[int], token: int, calculator: bool) -> list[int]:
    """The calculator's tokens to append after `token` (none unless it closes an open `<<EXPR=`)."""
    if not calculator or not llm.detokenize([token]).decode("utf-8", errors="ignore").endswith("="):
        return []
    from lowmem_grpo.rewards.calculator import forced_text, pending_expression

    expr = pending_expression(llm.detokenize(completion).decode("utf-8", errors="ignore"))
    text = forced_text(expr) if expr is not None else None
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) if text else []


def greedy(llm: Any, prompt: list[int], max_new_tokens: int, eos: set[int], calculator: bool) -> dict[str, Any]:
    """One greedy continuation of `prompt`, the calculator's results forced in."""
    completion: list[int] = []
    forced = 0
    ended = False
    while not ended and len(completion) < max_new_tokens:
        restart = False
        for token in llm.generate(prompt + completion, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if token in eos:
                ended = True
                break
            completion.append(token)
            extra = _forced(llm, completion, token, calculator)
            if extra or len(completion) >= max_new_tokens:
                take = extra[:max_new_tokens - len(completion)]
                completion += take
                forced += len(take)
                restart = bool(extra)
                break
        if not restart:
            break
    text = llm.detokenize(completion).decode("utf-8", errors="replace")
    return {"ids": completion, "text": text, "tokens": len(completion) + int(ended),
            "truncated": not ended and len(completion) >= max_new_tokens, "forced_tokens": forced}


def run_generate(job: dict[str, Any]) -> dict[str, Any]:
    """Greedy continuations of prompt texts tokenized by llama.cpp (special tokens parsed, no BOS added)."""
    repack = repack_allowed(job)
    llm = _load(job["model"], int(job["n_ctx"]), repack=repack)
    eos = set(job.get("eos_ids") or []) | {llm.token_eos()}
    out = []
    started = time.monotonic()
    for text in job["prompts"]:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        row = greedy(llm, prompt, int(job["max_new_tokens"]), eos, bool(job.get("calculator")))
        out.append({"prompt_ids": prompt, **row})
    return {"generations": out, "seconds": time.monotonic() - started,
            "chat_template": llm.metadata.get("tokenizer.chat_template"), "repack": repack,
            "extra_buffers": bool(llm.model_params.use_extra_bufts)}


def run_logits(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    llm = _load(job["model"], int(job["n_ctx"]), logits_all=True, repack=repack_allowed(job))
    arrays = {}
    for i, ids in enumerate(job["sequences"]):
        llm.reset()
        llm.eval(ids)
        arrays[f"seq{i}"] = np.array(llm.scores[:len(ids)], dtype=np.float32)
    np.savez(job["logits_file"], **arrays)
    return {"sequences": len(arrays)}


def run_quantize(job: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[job["type"]])
    started = time.monotonic()
    code = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), params)
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return {"seconds": time.monotonic() - started}


JOBS = {"generate": run_generate, "logits": run_logits, "quantize": run_quantize}


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    Path(request["result"]).write_text(json.dumps(JOBS[request["job"]](request)), encoding="utf-8")
