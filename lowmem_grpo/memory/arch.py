"""Model architectures for the memory planner, from a config.json: a local folder's, a shipped one
(`resources/configs/<hub id with / as __>.json`), else the hub's."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "resources" / "configs"
EMBEDDED_ARCHITECTURES = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
QKV_BIAS_TYPES = {"qwen2"}  # q/k/v biases even where the config does not say so
QK_NORM_TYPES = {"qwen3", "gemma3_text", "gemma3"}  # a per-head RMSNorm on q and k
FOUR_NORM_TYPES = {"gemma2", "gemma3_text", "gemma3"}  # pre/post attention and feed-forward norms


@dataclass(frozen=True)
class Architecture:
    """The numbers of a decoder-only transformer that memory depends on."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def small_params_per_layer(self) -> int:
        """Unquantized parameters of one layer: RMSNorm weights, q/k norms, q/k/v biases."""
        count = self.norms_per_layer * self.hidden_size
        if self.qk_norm:
            count += 2 * self.head_dim
        if self.qkv_bias:
            count += self.q_dim + 2 * self.kv_dim
        return count

    def embedding_params(self) -> int:
        """Input embedding, plus a separate lm_head when the embeddings are not tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def total_params(self) -> int:
        """All parameters, counted as transformers counts them (tied weights once)."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + self.small_params_per_layer()
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size  # + final norm

    def kv_tokens(self, seq_len: int) -> int:
        """Cached key/value positions summed over layers (sliding-window layers keep at most the window)."""
        if not self.layer_types or not self.sliding_window:
            return self.num_layers * seq_len
        window = min(seq_len, self.sliding_window)
        return sum(window if kind == "sliding_attention" else seq_len for kind in self.layer_types)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal ones nest it under text_config)."""
    nested = config.get("text_config")
    if isinstance(nested, dict) and "hidden_size" in nested:
        return {**nested, "model_type": nested.get("model_type", config.get("model_type", "")),
                "tie_word_embeddings": nested.get("tie_word_embeddings", config.get("tie_word_embeddings", True))}
    return config


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if isinstance(cfg.get("layer_types"), list):
        return tuple(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern")
    if pattern and cfg.get("sliding_window"):
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first_full = cfg.get("max_window_layers", num_layers)
        return tuple("sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers))
    return ()


def architecture_from_config(config: dict[str, Any], source: str = "") -> Architecture:
    """An Architecture from a parsed config.json; BadInputError naming a missing key."""
    cfg = _text_config(config)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        raise BadInputError(f"model config {source or '(given)'} lacks {', '.join(missing)}: not a decoder-only "
                            "transformer the planner knows", fix="plan a llama/qwen/gemma-style causal LM, or "
                            "pass --gpu-memory with a recipe whose model.name has a standard config.json")
    model_type = str(cfg.get("model_type", ""))
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    return Architecture(
        model_type=model_type, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), vocab_size=cfg["vocab_size"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)) or model_type in QKV_BIAS_TYPES,
        qk_norm=model_type in QK_NORM_TYPES, norms_per_layer=4 if model_type in FOUR_NORM_TYPES else 2,
        sliding_window=window, layer_types=_layer_types(cfg, layers), source=source)


def shipped_config_path(name: str) -> Path | None:
    """The shipped config for a hub id (or embedded name), matched case-insensitively; None if none."""
    wanted = EMBEDDED_ARCHITECTURES.get(name, name).replace("/", "__").lower() + ".json"
    return next((path for path in sorted(CONFIGS_DIR.glob("*.json")) if path.name.lower() == wanted), None)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path}: cannot read the model config ({exc})",
                            fix="point model.name at a folder with a valid config.json") from exc


def load_architecture(name: str, *, allow_hub: bool = True) -> Architecture:
    """The architecture of model.name: local folder, else shipped config, else the hub."""
    local = Path(name).expanduser()
    if not name.startswith("embedded:") and local.is_dir():
        config = local / "config.json"
        if not config.exists():
            raise BadInputError(f"model.name {name!r}: folder has no config.json",
                                fix="point model.name at a saved model folder or a hub id")
        return architecture_from_config(_read_json(config), str(config))
    shipped = shipped_config_path(name)
    if shipped is not None:
        return architecture_from_config(_read_json(shipped), f"shipped:{shipped.name}")
    if name.startswith("embedded:"):
        raise BadInputError(f"no architecture is known for {name!r}",
                            fix=f"use one of {', '.join(EMBEDDED_ARCHITECTURES)}")
    if not allow_hub:
        raise BadInputError(f"model.name {name!r}: no local folder and no shipped config",
                            fix="point model.name at a local folder with a config.json, or allow the hub")
    log.info("reading the architecture of %s from the hub", name)
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id=name, filename="config.json")
    except Exception as exc:  # network, gated repo, unknown id: all mean "no config here"
        raise BadInputError(
            f"model.name {name!r}: no local folder, no shipped config, and the hub's config.json could not be "
            f"read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            fix="connect to the hub (and set HF_TOKEN for gated models), or point model.name at a local folder "
                f"with a config.json, or add {CONFIGS_DIR}/{name.replace('/', '__')}.json",
        ) from exc
    return architecture_from_config(_read_json(Path(path)), f"hub:{name}")
