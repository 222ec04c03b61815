"""Triton implementations of the paged-KV-cache ops, with the references' signatures.

``pdserve.kernels`` (the dispatcher) calls these for CUDA tensors or when
``PDSERVE_KERNELS=triton``. Each wrapper validates shapes, allocates its output, computes the
grid and passes strides; the kernels live in ``triton_cache`` (cache write),
``triton_attention`` (decode and prefill attention) and ``triton_blocks`` (block gather/scatter).

The attention wrappers take an optional ``out`` beyond the reference signature so that tests can
hand in a NaN-poisoned buffer: an element the kernel forgets to write then fails the comparison.
"""

from __future__ import annotations

import torch

from pdserve.kernels.reference import window_size
from pdserve.kernels.triton.attention import launch_paged_attention
from pdserve.kernels.triton.blocks import launch_copy_blocks
from pdserve.kernels.triton.cache import launch_reshape_and_cache


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K and V into the cache slot ``slot_mapping[i]`` (skipping slots < 0)."""
    launch_reshape_and_cache(key, value, kv_cache_layer, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the query token
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    *,
    sliding_window: int | None = None,  # W: the query at p sees p - W < k <= p; None or 0: all
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Single-token attention over each sequence's paged context (GQA by head grouping)."""
    if out is None:
        out = torch.empty_like(query)
    return launch_paged_attention(
        query,
        kv_cache_layer,
        block_tables,
        None,
        seq_lens,
        scale,
        out,
        sliding_window=window_size(sliding_window),
    )


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query chunks, concatenated
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: chunk boundaries in `query`
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the chunk
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,  # W: the query at p sees p - W < k <= p; None or 0: all
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each query chunk over its cached prefix and itself.

    Query token ``i`` of a chunk of length ``q`` sits at position ``seq_len - q + i``. The
    chunk's own K/V must already be in the cache (``reshape_and_cache`` first).
    """
    if out is None:
        out = torch.empty_like(query)
    return launch_paged_attention(
        query,
        kv_cache_layer,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        out,
        sliding_window=window_size(sliding_window),
    )


def gather_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    out: torch.Tensor | None = None,  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:
    """Pack the listed blocks (all layers) into one contiguous buffer, in ``block_ids`` order."""
    if out is None:
        out = kv_cache.new_empty((block_ids.numel(), *kv_cache.shape[1:]))
    launch_copy_blocks(kv_cache, block_ids, out, gather=True)
    return out


def scatter_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    src: torch.Tensor,  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
) -> None:
    """Unpack a contiguous buffer produced by ``gather_blocks`` into the listed block ids."""
    launch_copy_blocks(kv_cache, block_ids, src, gather=False)


__all__ = [
    "gather_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "scatter_blocks",
]
