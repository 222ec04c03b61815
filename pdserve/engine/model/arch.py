"""The architecture numbers a decoder-only checkpoint needs, independent of its file format.

Both loaders (GGUF metadata, HF ``config.json``) reduce to this one dataclass, so the model, the
KV cache and the handshake never look at a file format again. ``family`` names the module that
builds the model (``weights.MODEL_FAMILIES``: ``llama.py``, ``qwen3.py``, ``gemma3.py``); the other
fields are numbers any family may read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.engine.kv_layout import KVCacheSpec, parse_dtype

# HF ``model_type`` -> the family that serves it. Mistral and Qwen2 have Llama's layers (Qwen2
# adds q/k/v biases, Mistral a sliding window); Qwen3 adds qk-norm; Gemma 3 is its own.
MODEL_TYPE_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPE_FAMILIES)


class UnsupportedModelError(ValueError):
    """A checkpoint pdserve cannot serve (its architecture, or a feature of it), raised when its
    config is read, before any weight: the message is one line naming what is supported."""


# HF ``layer_types`` entries: a layer attends over the last ``sliding_window`` keys or all of them.
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArchConfig:
    """Shapes and constants of a decoder-only model of one of the supported families."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # HF-style scaling dict ({"rope_type": "llama3", "factor": ...}); None = plain RoPE. With a
    # local base (Gemma 3) it scales the full-attention layers' RoPE only, as HF does.
    rope_scaling: dict | None = None
    family: str = "llama"  # the model family that builds it (``weights.MODEL_FAMILIES``)
    # Keys a query at position p attends to: p - sliding_window < k <= p, on the layers that
    # ``sliding_layers`` marks (None: every layer); no window: all keys up to p.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    # The RoPE base of the sliding layers when it differs from the others' (Gemma 3: 10k local,
    # 1M global); None: one base for every layer.
    rope_local_theta: float | None = None
    # The attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # logits = cap * tanh(logits / cap) (Gemma 2; None for Gemma 3 and the others).
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_layers is not None:
            self.sliding_layers = tuple(bool(s) for s in self.sliding_layers)
            if len(self.sliding_layers) != self.num_layers:
                raise ValueError(
                    f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to every key)."""
        if self.sliding_window is None or (
            self.sliding_layers is not None and not self.sliding_layers[layer]
        ):
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_cache_spec(self, block_size: int, dtype: str | torch.dtype = "float32") -> KVCacheSpec:
        """The paged KV cache this model writes, in pdserve's one layout."""
        name = str(parse_dtype(dtype)).removeprefix("torch.")
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=name,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        """From a ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x
        ``rope_parameters``)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in MODEL_TYPE_FAMILIES:
            raise UnsupportedModelError(
                f"config.json: model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        family = MODEL_TYPE_FAMILIES[model_type]
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError(
                "config.json: attn_logit_softcapping is not supported (Gemma 2's; Gemma 3 has none)"
            )
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling, rope_local_theta = _hf_rope(cfg)
        window, sliding_layers = _hf_sliding(cfg, model_type, num_layers)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            # Qwen2 configs carry no flag: their q/k/v projections always have a bias.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
            rope_scaling=rope_scaling,
            family=family,
            sliding_window=window,
            sliding_layers=sliding_layers,
            rope_local_theta=rope_local_theta if family == "gemma3" else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if family == "gemma3" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float]:
    """``(rope_theta, rope_scaling, local rope_theta)``: the full-attention layers' base and
    scaling, and the sliding layers' base (Gemma 3's ``rope_local_base_freq``, 10k by default)."""
    params = cfg.get("rope_parameters")
    local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    if isinstance(params, dict) and FULL in params:  # transformers 5.x, one entry per layer type
        local_theta = float((params.get(SLIDING) or {}).get("rope_theta", local_theta))
        params = params[FULL]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        default_theta = 1_000_000.0 if cfg.get("model_type") == "gemma3_text" else 10000.0
        theta = float(cfg.get("rope_theta", default_theta))
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None, local_theta
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling, local_theta


def _hf_sliding(
    cfg: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, sliding_layers)`` as transformers reads them: ``layer_types`` when the
    config lists them, else Gemma 3's ``sliding_window_pattern`` (every 6th layer global), Qwen's
    ``use_sliding_window`` from ``max_window_layers`` on, and Mistral's window on every layer."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, None
    if cfg.get("layer_types"):
        kinds = cfg["layer_types"]
        if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
            raise ValueError(
                f"config.json: layer_types {kinds} (expected {num_layers} of {SLIDING!r}, {FULL!r})"
            )
        sliding = tuple(kind == SLIDING for kind in kinds)
    elif model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
    elif model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", num_layers)
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        return int(window), None
    return (int(window), sliding) if any(sliding) else (None, None)


def _first_id(value: int | list[int] | None) -> int | None:
    # Llama 3 lists several end tokens; the first is the one a tokenizer calls eos.
    if isinstance(value, list):
        return value[0] if value else None
    return value
