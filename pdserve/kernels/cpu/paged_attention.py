"""Decode attention read straight from the paged KV cache on the CPU (``kernels/cpu/csrc/paged_attention.c``).

The torch reference (``reference.paged_attention_decode_ref``) copies every sequence's blocks
into one contiguous buffer, pads each group of sequences to its longest, and calls SDPA: at a
batch of 8 sequences of ~300 tokens that was 17 of a 54 ms bf16 decode step of SmolLM2-135M on
one core. The C kernel reads each position's K and V in place, once for all the query heads
sharing its KV head.

It serves bf16 and fp32 caches, with AVX-512 (16-wide) or AVX2 (8-wide) vectors where the
CPU has them. Both compute in fp32: for a bf16 cache the kernel differs from SDPA by a rounding
of the bf16 output at most; for an fp32 one by float rounding (another summation order, ~1e-7;
tested), and each sequence's result does not depend on what it is batched with (one task per
sequence), where the reference pads a group of sequences to its longest. fp32 caches kept the
reference while only AVX-512 had a vector path: on AVX2 CPUs (AMD Zen 2/3), where
``--dtype auto`` picks fp32, the portable loop was slower than SDPA at 8 sequences.

A sliding window (``sliding_window``) starts each sequence at its window's first position: the
blocks before it are never read, so a long context costs its window (the reference's mask,
``reference``'s docstring); without one the kernel runs exactly as before.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.cpu.build import CLibrary
from pdserve.kernels.reference import window_size
from pdserve.kernels.scratch import scratch

MAX_GROUP = 16  # query heads per KV head (the C side's MAX_GROUP)
MAX_HEADS = 128  # (MAX_HEADS)
MAX_HEAD_DIM = 256  # (MAX_HEAD_DIM)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_paged_decode_attention.argtypes = [
        ptr, cint, ptr, cint, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_float, ptr, ptr, i64, cint,
    ]  # fmt: skip
    lib.pd_paged_decode_attention.restype = None
    lib.pd_paged_attention_vector_lanes.argtypes = []
    lib.pd_paged_attention_vector_lanes.restype = cint


KERNELS = CLibrary(("paged_attention",), _declare, "paged decode attention")


@functools.cache
def vector_lanes() -> int:
    """The kernel's vector width here (16: AVX-512, 8: AVX2), 0 with only its portable loop
    (asked once: the library a process loads does not change)."""
    return int(KERNELS.load().pd_paged_attention_vector_lanes())


def serves(query: torch.Tensor, kv_cache_layer: torch.Tensor) -> bool:
    """True when the C kernel runs this call: a bf16 cache, or an fp32 one where the vector path
    takes this head_dim (the portable loop loses to SDPA there), on the CPU, head shapes it
    supports, and the library built here."""
    return query.dtype in (torch.bfloat16, torch.float32) and serves_heads(
        query.shape[1], query.shape[2], kv_cache_layer
    )


def serves_heads(num_heads: int, head_dim: int, kv_cache_layer: torch.Tensor) -> bool:
    """``serves`` for queries of ``num_heads`` heads of ``head_dim`` (fp32 or bf16), whatever
    their batch: what a caller that makes the query itself asks before it runs."""
    num_kv_heads = kv_cache_layer.shape[3]
    return (
        kv_cache_layer.dtype in (torch.bfloat16, torch.float32)
        and kv_cache_layer.device.type == "cpu"
        and kv_cache_layer.shape[-1] == head_dim
        and kv_cache_layer[0].is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and num_heads <= MAX_HEADS
        and head_dim <= MAX_HEAD_DIM
        and KERNELS.available()
        and (kv_cache_layer.dtype == torch.bfloat16 or _vector_path_takes(head_dim))
    )


def _vector_path_takes(head_dim: int) -> bool:
    lanes = vector_lanes()
    return lanes > 0 and head_dim % lanes == 0


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the query token
    scale: float,
    *,
    sliding_window: int | None = None,  # W: the query at p sees p - W < k <= p; None or 0: all
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], query's dtype
    """Single-token attention over each sequence's paged context (GQA), as the reference computes it."""
    window = window_size(sliding_window)
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache_layer.shape
    if cache_head_dim != head_dim or not kv_cache_layer[0].is_contiguous():
        raise ValueError(f"KV cache {tuple(kv_cache_layer.shape)} does not fit queries {tuple(query.shape)}")
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    max_len = tables.shape[1] * block_size
    if window:  # a sequence scores its window's positions at most
        max_len = min(max_len, window)
    threads = min(torch.get_num_threads(), num_seqs * num_kv_heads)
    # Per thread: every head's scores over the context, then its scaled query and its sums.
    scores = scratch(
        "decode_scores", (threads * (max_len + 2 * head_dim) * num_heads,), torch.float32, query.device
    )
    KERNELS.load().pd_paged_decode_attention(
        query.data_ptr(),
        int(query.dtype == torch.bfloat16),
        kv_cache_layer.data_ptr(),
        int(kv_cache_layer.dtype == torch.bfloat16),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        kv_cache_layer.stride(0),  # a layer's view of the engine's cache: blocks hold every layer
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        window,
        scale,
        out.data_ptr(),
        scores.data_ptr(),
        max_len,
        threads,
    )
    return out
