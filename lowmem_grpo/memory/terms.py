"""The terms of the GRPO memory model: one function per term, its formula in its docstring (docs/memory.md).

Notation: L layers, H hidden_size, I intermediate_size, V vocab_size, q = heads x head_dim, kv = kv_heads x head_dim,
r LoRA rank, cb bytes of the compute dtype, rb unquantized_bytes, P prompt tokens, C completion tokens, S = P + C,
b per-device micro-batch, R generation batch, G num_generations, k = min(b, R / G) the prompts of one micro-batch
(TRL shuffles the rows), T the tokens of one training forward, E = eval_batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lowmem_grpo.memory.arch import Architecture

MIB = 2**20
GIB = 2**30
NF4_BLOCK = 64  # bitsandbytes 4-bit blocksize: one absmax per 64 weights
DQ_BLOCK = 256  # double quantization: one fp32 absmax per 256 quantized absmax values
NF4_CODE_BYTES = 64  # the 16-entry fp32 nf4 code table of each quantized tensor
DQ_CODE_BYTES = 1024  # the 256-entry fp32 dynamic code of each tensor's second-level (double) quantization
OPT8_BLOCK = 256  # bitsandbytes blockwise 8-bit optimizer: one fp32 absmax per 256 values per state
OPT8_QMAP_BYTES = 1024  # the 256-entry fp32 quantization map of each 8-bit state
OPT8_MIN_SIZE = 4096  # tensors below this many elements keep 32-bit optimizer states in bitsandbytes
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context, cuBLAS/cuDNN handles and loaded kernels (outside torch's allocator)
ALLOCATOR_SLACK = 0.10  # reserved-but-unallocated share of the transient phase (caching allocator fragmentation)
# Unsloth's fast decode grows its own KV buffers by this many positions (unsloth/models/llama.py, gemma2.py);
# the types it loads through FastModel (Gemma 3) decode with transformers' cache
UNSLOTH_DECODE_INCREMENTS = {"llama": 512, "mistral": 512, "qwen2": 512, "qwen3": 512, "gemma": 512, "gemma2": 256}
VLLM_MIN_OVERHEAD = 1 * GIB  # vLLM's own activations and CUDA graphs inside its reservation

EIGHT_BIT_OPTIMIZERS = {"adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adam_8bit", "adam_8bit",
                        "paged_lion_8bit", "lion_8bit", "rmsprop_bnb_8bit"}
PAGED_OPTIMIZERS = {"paged_adamw_8bit", "paged_adamw_32bit", "paged_adamw", "paged_adam_8bit", "paged_adam_32bit",
                    "paged_lion_8bit", "paged_lion_32bit"}
ONE_STATE_OPTIMIZERS = {"lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit", "rmsprop_bnb_8bit", "rmsprop"}
STATELESS_OPTIMIZERS = {"sgd"}


@dataclass(frozen=True)
class Settings:
    """The recipe's memory-relevant settings, resolved for a CUDA run."""

    backend: str  # "unsloth" or "hf"
    load_in_4bit: bool
    compute_bytes: int
    lora_r: int
    target_modules: tuple[str, ...]
    optim: str
    gradient_checkpointing: bool
    per_device_batch: int
    generation_batch: int
    num_generations: int
    prompt_len: int
    completion_len: int
    beta: float
    fast_inference: bool
    gpu_memory_utilization: float
    gpu_total_bytes: int
    gpu_free_bytes: int = 0  # free GPU memory when the model loads (0: unknown, taken as gpu_total_bytes)
    prompt_sharing: str = "none"  # none or shared_prompt (hf; memory.sharing)
    eval_batch: int = 0  # sequences an evaluation decodes at once through the sampling engine (0: none runs there)

    @property
    def seq_len(self) -> int:
        """S = P + C, the padded length of every sequence (worst case: no completion ends early)."""
        return self.prompt_len + self.completion_len


def nf4_tensor_bytes(numel: int) -> int:
    """Bytes of one bitsandbytes nf4 tensor with double quantization (every 4-bit load here): packed data, absmax per
    64-block quantized again per 256, code tables (quantize_4bit)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + math.ceil(blocks / DQ_BLOCK) * 4 + 4 + NF4_CODE_BYTES + DQ_CODE_BYTES


def unquantized_bytes(s: Settings) -> int:
    """rb, of the unquantized layers and residual stream: 4 on hf with 4-bit (peft casts them to fp32), else cb."""
    return 4 if (s.backend == "hf" and s.load_in_4bit) else s.compute_bytes


def base_weights(a: Architecture, s: Settings) -> int:
    """Frozen base model weights.

    4-bit: L x 7 nf4 projections + the unquantized parameters x rb; 16-bit: total_params x cb; vLLM: 0 (its own)."""
    if s.fast_inference:
        return 0
    if not s.load_in_4bit:
        return a.total_params() * s.compute_bytes
    quantized = a.num_layers * sum(nf4_tensor_bytes(i * o) for i, o in a.linear_shapes().values())
    small = a.embedding_params() + a.num_layers * a.small_params_per_layer() + a.hidden_size
    return quantized + small * unquantized_bytes(s)


def lora_tensors(a: Architecture, s: Settings) -> list[int]:
    """Element counts of every LoRA matrix (A: r x in, B: out x r) per layer and target (head targets once)."""
    shapes = a.linear_shapes()
    sizes: list[int] = []
    for name in s.target_modules:
        if name in shapes:
            fan_in, fan_out = shapes[name]
            sizes += [s.lora_r * fan_in, fan_out * s.lora_r] * a.num_layers
        elif name in ("lm_head", "embed_tokens"):
            sizes += [s.lora_r * a.hidden_size, a.vocab_size * s.lora_r]
    return sizes


def lora_param_count(a: Architecture, s: Settings) -> int:
    """Trainable parameters: L x sum over targets of r x (in + out) (+ r x (H + V) per head target)."""
    return sum(lora_tensors(a, s))


def lora_params(a: Architecture, s: Settings) -> int:
    """LoRA weights: lora_param_count x 4 (both backends keep trainable adapters in fp32)."""
    return lora_param_count(a, s) * 4


def optimizer_state(a: Architecture, s: Settings) -> int:
    """Optimizer state of the LoRA parameters, per tensor of n elements.

    AdamW 8n; 8-bit 2 x (n + ceil(n/256) x 4 + 1024) from n = 4096; Lion/RMSprop half that; sgd 0."""
    if s.optim in STATELESS_OPTIMIZERS:
        return 0
    states = 1 if s.optim in ONE_STATE_OPTIMIZERS else 2
    total = 0
    for n in lora_tensors(a, s):
        if s.optim in EIGHT_BIT_OPTIMIZERS and n >= OPT8_MIN_SIZE:
            total += states * (n + math.ceil(n / OPT8_BLOCK) * 4 + OPT8_QMAP_BYTES)
        else:
            total += states * 4 * n
    return total


def batch_buffers(a: Architecture, s: Settings) -> int:
    """The generation batch kept for the whole step: R x S x 16 (int64 ids + int64 mask) + R x C x 8
    (fp32 old log-probs and per-token advantages)."""
    return s.generation_batch * s.seq_len * 16 + s.generation_batch * s.completion_len * 8


def reference_model(a: Architecture, s: Settings) -> int:
    """Reference model when beta > 0.

    Scored with the adapter disabled, it shares the base weights: R x C x 4 of log-probs."""
    return s.generation_batch * s.completion_len * 4 if s.beta > 0 else 0


def vllm_reservation(a: Architecture, s: Settings) -> int:
    """vLLM's pool when fast_inference: gpu_memory_utilization x the GPU memory free when the model loads
    (gpu_free_bytes, else the budget; Unsloth rescales the share by free memory, unsloth_zoo/vllm_utils.py)."""
    if not s.fast_inference:
        return 0
    return int(s.gpu_memory_utilization * (s.gpu_free_bytes or s.gpu_total_bytes))


def vllm_minimum(a: Architecture, s: Settings) -> int:
    """The least vLLM reservation that runs the step: weights + the generation KV cache + VLLM_MIN_OVERHEAD."""
    plain = dataclasses.replace(s, fast_inference=False)
    return base_weights(a, plain) + kv_cache(a, plain) + VLLM_MIN_OVERHEAD


def cuda_context(a: Architecture, s: Settings) -> int:
    """CUDA context, library handles and loaded kernels: a constant CUDA_CONTEXT_BYTES (512 MiB),
    outside torch's allocator."""
    return CUDA_CONTEXT_BYTES


def decode_kv_bytes(a: Architecture, s: Settings, rows: int) -> int:
    """The KV cache of `rows` sequences decoded to S tokens: positions x 2 x kv x cb, positions rows x kv_tokens(S)
    on transformers' cache, rows x L x (P + 1 + inc x ceil(C / inc) + P) in Unsloth's fast decode buffers."""
    increment = UNSLOTH_DECODE_INCREMENTS.get(a.model_type) if s.backend == "unsloth" else None
    if increment:
        positions = a.num_layers * (2 * s.prompt_len + 1 + increment * math.ceil(s.completion_len / increment))
    else:
        positions = a.kv_tokens(s.seq_len)
    return rows * positions * 2 * a.kv_dim * s.compute_bytes


def kv_cache(a: Architecture, s: Settings) -> int:
    """Generation KV cache of the generation batch R: decode_kv_bytes(R), e.g. on unsloth
    R x L x (P + 1 + 512 x ceil(C / 512) + P) x 2 x kv x cb; 0 with vLLM."""
    return 0 if s.fast_inference else decode_kv_bytes(a, s, s.generation_batch)


def generation_workspace(a: Architecture, s: Settings) -> int:
    """Transient memory of generating: the prefill of one layer R x P x (H x rb + 2I x cb), the
    dequantized copy of the largest 4-bit weight max(in x out) x cb, and the last position's fp32
    logits and probabilities R x V x 4 x 2. With vLLM: 0 (inside its reservation)."""
    return 0 if s.fast_inference else decode_workspace(a, s, s.generation_batch)


def decode_workspace(a: Architecture, s: Settings, rows: int) -> int:
    """generation_workspace's formula for `rows` sequences prefilled and sampled at once."""
    prefill = rows * s.prompt_len * (a.hidden_size * unquantized_bytes(s) + 2 * a.intermediate_size * s.compute_bytes)
    return prefill + dequant_workspace(a, s) + rows * a.vocab_size * 4 * 2


def eval_kv_cache(a: Architecture, s: Settings) -> int:
    """KV cache of an evaluation through the sampling engine, E = eval_batch sequences at once: decode_kv_bytes(E),
    outside vLLM's reservation; 0 without one."""
    return decode_kv_bytes(a, s, s.eval_batch) if s.eval_batch else 0


def eval_workspace(a: Architecture, s: Settings) -> int:
    """Transient memory of that evaluation: decode_workspace(E), the prefill of one layer E x P x (H x rb + 2I x cb),
    the dequantized 4-bit weight, the sampled position's fp32 logits and probabilities E x V x 8. 0 without one."""
    return decode_workspace(a, s, s.eval_batch) if s.eval_batch else 0


def dequant_workspace(a: Architecture, s: Settings) -> int:
    """bitsandbytes dequantizes each 4-bit weight for its matmul: max(in x out) x cb at a time (0 in 16-bit)."""
    return max(i * o for i, o in a.linear_shapes().values()) * s.compute_bytes if s.load_in_4bit else 0


def lora_grads(a: Architecture, s: Settings) -> int:
    """Gradients of the LoRA parameters: lora_param_count x 4 (fp32, freed after each optimizer step)."""
    return lora_param_count(a, s) * 4


def layer_activation_bytes_per_token(a: Architecture, s: Settings) -> int:
    """What autograd keeps for one decoder layer, per token: rb x (norms + 2) x H + cb x (3q + 2kv (+ q + kv with
    q/k norms) + m x I (m = 3 on hf, 2 with Unsloth's fused SwiGLU) + r x targets) + 4 x (norms + heads)."""
    targets = sum(1 for name in s.target_modules if name in a.linear_shapes())
    mlp = 2 if s.backend == "unsloth" else 3
    width = 3 * a.q_dim + 2 * a.kv_dim + mlp * a.intermediate_size + s.lora_r * targets
    if a.qk_norm:
        width += a.q_dim + a.kv_dim
    residual = (a.norms_per_layer + 2) * a.hidden_size * unquantized_bytes(s)
    return residual + width * s.compute_bytes + 4 * (a.norms_per_layer + a.num_heads)


def prompts_in_micro_batch(s: Settings) -> int:
    """k = min(b, R / G), at least 1: the distinct prompts one micro-batch can hold."""
    return max(1, min(s.per_device_batch, s.generation_batch // max(s.num_generations, 1)))


def forward_tokens(a: Architecture, s: Settings, shared: bool | None = None) -> int:
    """T, the tokens of one training forward: b x S; with a shared-prompt pass k x P + b x C."""
    shared = s.prompt_sharing != "none" if shared is None else shared
    if shared:
        return prompts_in_micro_batch(s) * s.prompt_len + s.per_device_batch * s.completion_len
    return s.per_device_batch * s.seq_len


def attention_mask_bytes(s: Settings, shared: bool) -> int:
    """The training forward's bool mask: b x S x S; hf shared b x C x S + k x P x P."""
    if not shared:
        return s.per_device_batch * s.seq_len * s.seq_len
    return s.per_device_batch * s.completion_len * s.seq_len + prompts_in_micro_batch(s) * s.prompt_len * s.prompt_len


def _forward_activations(a: Architecture, s: Settings, shared: bool) -> int:
    tokens = forward_tokens(a, s, shared)
    per_token = layer_activation_bytes_per_token(a, s)
    hidden = tokens * a.hidden_size * unquantized_bytes(s)
    if not s.gradient_checkpointing:
        body = a.num_layers * tokens * per_token
    elif s.backend == "unsloth":
        body = 2 * hidden + tokens * per_token
    else:
        body = a.num_layers * hidden + tokens * per_token
    return body + 4 * hidden + attention_mask_bytes(s, shared) + dequant_workspace(a, s)


def activations(a: Architecture, s: Settings) -> int:
    """Activations of the training forward/backward of one micro-batch of T tokens (forward_tokens: b x S, or
    k x P + b x C with a shared-prompt pass).

    L x T x per_token; checkpointed L x T x H x rb + T x per_token (Unsloth offloads: 2 x T x H x rb); + 4 x T x H
    x rb + mask + dequant."""
    return _forward_activations(a, s, s.prompt_sharing != "none")


def prompt_kv(a: Architecture, s: Settings) -> int:
    """The prompt's keys/values each completion row attends to, hf shared-prompt pass (0 otherwise: unshared rows
    count theirs in the activations): L x b x P x 2 x kv x cb, with checkpointing L x k x P x ... + one layer's b."""
    if s.prompt_sharing != "shared_prompt":
        return 0
    per_row_layer = s.prompt_len * 2 * a.kv_dim * s.compute_bytes
    if not s.gradient_checkpointing:
        return a.num_layers * s.per_device_batch * per_row_layer
    return a.num_layers * prompts_in_micro_batch(s) * per_row_layer + s.per_device_batch * per_row_layer
