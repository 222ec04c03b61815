"""Rotary position embeddings: the inverse frequencies (with the checkpoints' scalings), the
per-position tables a forward pass reads, and HF's "rotate_half" application."""

from __future__ import annotations

import math

import torch

from pdserve.engine.model.arch import ModelArchConfig


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32, computed exactly as transformers does."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs.weight (Llama 3.1+ GGUF files)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope_scaling type {rope_type!r} (supported: default, linear, llama3, freq_factors)"
    )


def rope_tables(config: ModelArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, cat(-sin, sin))`` per position, ``[max_position_embeddings, head_dim]`` in float32:
    what ``apply_rope`` takes, looked up by position. Computed on the CPU explicitly, so a model
    built under ``torch.device("meta")`` for fast loading still gets real tables."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
    freqs = torch.outer(positions, rope_inv_freq(config))  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x: [T, heads, D]`` (a new, contiguous tensor).

    ``sin_signed`` is ``cat(-sin, sin)``, so ``rotate_half(x) * sin == cat(x2, x1) * sin_signed``
    (negation is exact, so this equals HF's result bit for bit before the fused add).
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)
