"""The architecture numbers a Llama-family checkpoint needs, independent of its file format.

Both loaders (GGUF metadata, HF ``config.json``) reduce to this one dataclass, so the model, the
KV cache and the handshake never look at a file format again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.engine.kv_layout import KVCacheSpec, parse_dtype

# HF ``model_type``s whose checkpoints are this architecture (Qwen2 = Llama + q/k/v bias).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelArchConfig:
    """Shapes and constants of a decoder-only Llama-family model."""

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
    # HF-style scaling dict ({"rope_type": "llama3", "factor": ...}); None = plain RoPE.
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} not in {SUPPORTED_MODEL_TYPES}")
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 configs carry no flag: their q/k/v projections always have a bias.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
            rope_scaling=rope_scaling,
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling


def _first_id(value: int | list[int] | None) -> int | None:
    # Llama 3 lists several end tokens; the first is the one a tokenizer calls eos.
    if isinstance(value, list):
        return value[0] if value else None
    return value
