"""A decoder layer with GGUF-block projections and the inputs of a decode pass over it: what the
fused-layer tests and the interleaved-kernel tests run the fused C call and the per-op path on."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML
from torch import nn

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from pdserve.engine.model.layers.quant_linear import QuantLinear
from pdserve.engine.model.llama import LlamaDecoderLayer
from pdserve.engine.model.weights import use_int8_activations

BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS = 16, 24, 2
CONFIG = ModelArchConfig(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_layers=NUM_LAYERS,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


# A config whose every projection takes K-quants (rows of whole 256s).
WIDE_CONFIG = ModelArchConfig(
    **{**CONFIG.to_dict(), "hidden_size": 256, "intermediate_size": 512, "num_heads": 8}
)
# Each K-quant's largest |w| per unit of its fp16 d (sc * q, with 6-bit or int8 scales).
_K_SPAN = {GGML.Q4_K: 63 * 15, GGML.Q5_K: 63 * 31, GGML.Q6_K: 127 * 32}
_K_D_OFFSET = {GGML.Q4_K: (0, 2), GGML.Q5_K: (0, 2), GGML.Q6_K: (208,)}


def random_gguf_blocks(ggml_type: GGML, rows: int, in_features: int, gen: torch.Generator) -> np.ndarray:
    """``[rows, row bytes]`` of ``ggml_type``: ``gguf``'s quantization of normal weights of std
    in_features^-0.5, or for the K-quants (which ``gguf`` does not quantize) random bytes whose
    fp16 scales keep the weights of that size."""
    scale = in_features**-0.5
    if ggml_type not in _K_SPAN:
        weights = (torch.randn(rows, in_features, generator=gen) * scale).numpy()
        return gguf.quants.quantize(weights.astype(np.float32), ggml_type)
    count = rows * in_features // 256
    block_bytes = gguf.GGML_QUANT_SIZES[ggml_type][1]
    raw = torch.randint(0, 256, (count, block_bytes), generator=gen, dtype=torch.uint8).numpy()
    for offset in _K_D_OFFSET[ggml_type]:
        d = (torch.rand(count, generator=gen) + 0.5) * (4 * scale / _K_SPAN[ggml_type])
        raw[:, offset : offset + 2] = d.numpy().astype(np.float16).view(np.uint8).reshape(count, 2)
    return raw.reshape(rows, -1)


# The HF parts of each fused projection, for a per-part choice of types.
_PARTS = {
    "qkv_proj": ("q", "k", "v"),
    "o_proj": ("o",),
    "gate_up_proj": ("gate", "up"),
    "down_proj": ("down",),
}


def quantized_layer(
    dtype: torch.dtype,
    ggml_type: GGML | dict[str, GGML],
    bias: bool,
    seed: int = 0,
    int8_activations: bool = False,
    sliding_window: int | None = None,
    config: ModelArchConfig = CONFIG,
    layer_class: type[nn.Module] = LlamaDecoderLayer,
    layer_index: int = 0,
) -> Any:
    """A decoder layer of ``config`` with random weights, its projections held as ``ggml_type``
    blocks, or each part (``q k v o gate up down``) as its entry of a dict, as llama.cpp's mixed
    "_M" files hold them (a fused projection of parts of different types is held in parts);
    quantizing their activations to int8 with ``int8_activations`` (``--quantization gguf-a8``),
    and attending through ``sliding_window`` as Mistral's layers do. ``layer_class``: another
    family's layer (Qwen3's, Gemma 3's), ``layer_index`` its place (Gemma 3's sliding layers)."""
    config = ModelArchConfig(**{**config.to_dict(), "attention_bias": bias})
    if sliding_window is not None:
        config = ModelArchConfig(**{**config.to_dict(), "sliding_window": sliding_window})
    gen = torch.Generator().manual_seed(seed)
    layer = layer_class(config, layer_index)
    with torch.no_grad():
        for norm in layer.modules():  # Gemma's weight w scales by 1 + w
            if isinstance(norm, RMSNorm):
                base = 0.0 if isinstance(norm, GemmaRMSNorm) else 1.0
                norm.weight.copy_(base + 0.1 * torch.randn(norm.weight.shape, generator=gen))
    layer = layer.to(dtype)
    attn, mlp = layer.self_attn, layer.mlp
    for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
        dense = getattr(owner, name)
        out_features, in_features = dense.weight.shape
        names = _PARTS[name]
        types = [ggml_type[part] if isinstance(ggml_type, dict) else ggml_type for part in names]
        sizes = {
            "q": config.num_heads * config.head_dim,
            "k": config.num_kv_heads * config.head_dim,
            "v": config.num_kv_heads * config.head_dim,
            "gate": config.intermediate_size,
            "up": config.intermediate_size,
        }
        rows = [sizes.get(part, out_features) for part in names]
        parts = []
        for part_type, part_rows in zip(types, rows, strict=True):
            raw = random_gguf_blocks(part_type, part_rows, in_features, gen)
            kind, blocks = to_kernel_blocks(part_type, raw, part_rows, in_features)
            if parts and parts[-1][0] is kind:
                parts[-1] = (kind, torch.cat([parts[-1][1], blocks]))
            else:
                parts.append((kind, blocks))
        b = None if dense.bias is None else (0.1 * torch.randn(out_features, generator=gen)).to(dtype)
        setattr(owner, name, QuantLinear.from_parts(parts, in_features, b))
    if int8_activations:
        use_int8_activations(layer)
    return layer.eval()


def decode_inputs(
    rows: int,
    dtype: torch.dtype,
    seed: int = 1,
    config: ModelArchConfig = CONFIG,
    thetas: tuple[float, ...] = (CONFIG.rope_theta,),
):
    """``(hidden, cos, sin_signed, cache, meta)`` for ``rows`` decode tokens of sequences with
    contexts of different lengths over a two-layer cache (the layer's view steps over the
    other layer, as the engine's does), whose earlier positions hold random K/V; a RoPE table
    per base of ``thetas`` (Gemma 3: the global one, then the local one)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = CONFIG.num_kv_heads, CONFIG.head_dim
    cache = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [5 + 23 * i for i in range(rows)]  # context incl. the new token: 5, 28, 51, ...
    tables, slots = [], []
    next_block = 0
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // BLOCK_SIZE)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (width - len(blocks)))
        slots.append(blocks[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    positions = torch.tensor([n - 1 for n in lens])
    cos_tables, sin_tables = [], []
    for theta in thetas:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(positions.float(), inv_freq)
        cos_tables.append(torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype))
        sin_tables.append(torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype))
    cos, sin_signed = torch.stack(cos_tables, 1), torch.stack(sin_tables, 1)  # [rows, tables, D]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=rows,
        decode_block_tables=torch.tensor(tables, dtype=torch.int32),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
    )
    hidden = torch.randn(rows, config.hidden_size, generator=gen).to(dtype)
    return hidden, cos, sin_signed, cache, meta


def per_op(layer: Any, *args) -> torch.Tensor:
    """The layer run op by op, as without the fused kernel."""
    fused, asked = layer._fused, layer._fused_asked
    layer._fused, layer._fused_asked = None, True
    try:
        return layer(*args)
    finally:
        layer._fused, layer._fused_asked = fused, asked
