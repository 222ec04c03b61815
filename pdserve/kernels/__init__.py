"""Paged-KV-cache kernels behind one dispatcher.

Every op has a torch reference (``reference.py``, what CPU runs) and a Triton kernel
(``triton/ops.py``, what CUDA runs); decode attention also has a C kernel for the CPU
(``cpu/paged_attention.py``), and so has a bf16 prefill chunk's attention to itself
(``cpu/causal_attention.py``), and so do the layer's RMSNorm, RoPE and KV write
(``cpu/layer_ops.py``, called by the model). The runner only calls the functions below, which pick the
implementation from the tensors' device. ``PDSERVE_KERNELS=triton`` forces Triton (used with
``TRITON_INTERPRET=1`` to run the Triton path on CPU in tests); ``PDSERVE_KERNELS=torch``
forces the reference.

The attention ops take a per-call (per-layer) ``sliding_window``: ``W`` >= 1 makes the query at
position ``p`` attend to positions ``p - W < k <= p`` only (transformers' and llama.cpp's
sliding-window mask: ``reference``'s docstring); ``None`` or 0 is full causal attention, the
same call, bit for bit, as without the argument.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from pdserve.kernels import reference
from pdserve.kernels.cpu import causal_attention as cpu_causal_attention
from pdserve.kernels.cpu import paged_attention as cpu_attention

_BACKEND_ENV = "PDSERVE_KERNELS"


def forced_backend() -> str:
    """``PDSERVE_KERNELS`` lower-cased: ``"triton"``, ``"torch"``, or ``""`` (pick by device).
    Read at every call: tests switch it within one process."""
    return os.environ.get(_BACKEND_ENV, "").lower()


def use_triton(tensor: torch.Tensor) -> bool:
    """True when this tensor's op should run the Triton kernel."""
    forced = forced_backend()
    if forced == "triton":
        return True
    if forced == "torch":
        return False
    return tensor.is_cuda


def _triton() -> ModuleType:
    from pdserve.kernels.triton import ops  # imported lazily: triton is optional on CPU

    return ops


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    impl = _triton().reshape_and_cache if use_triton(kv_cache_layer) else reference.reshape_and_cache_ref
    impl(key, value, kv_cache_layer, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton on CUDA; on the CPU the C kernel where it serves the call (``cpu_attention.serves``:
    bf16 caches, fp32 ones its vector path takes), else the torch reference (``PDSERVE_KERNELS=torch``,
    no C compiler, or an fp32 head size without a vector path). ``sliding_window``: the module
    docstring."""
    window = reference.window_size(sliding_window)
    if use_triton(kv_cache_layer):
        impl = _triton().paged_attention_decode
    elif forced_backend() != "torch" and cpu_attention.serves(query, kv_cache_layer):
        impl = cpu_attention.paged_attention_decode
    else:
        impl = reference.paged_attention_decode_ref
    if window:
        return impl(query, kv_cache_layer, block_tables, seq_lens, scale, sliding_window=window)
    return impl(query, kv_cache_layer, block_tables, seq_lens, scale)


def paged_attention_prefill(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``key``/``value``: the chunks' new K/V. The reference attends a chunk with no cached
    prefix over them directly (causal fast path); the Triton kernel reads everything from the
    cache and ignores them. ``sliding_window``: the module docstring."""
    window = reference.window_size(sliding_window)
    if use_triton(kv_cache_layer):
        if window:
            return _triton().paged_attention_prefill(
                query, kv_cache_layer, block_tables, query_start_loc, seq_lens, scale, sliding_window=window
            )
        return _triton().paged_attention_prefill(
            query, kv_cache_layer, block_tables, query_start_loc, seq_lens, scale
        )
    on_cpu = forced_backend() != "torch" and query.device.type == "cpu"
    return reference.paged_attention_prefill_ref(
        query,
        kv_cache_layer,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        key=key,
        value=value,
        self_attention=_cpu_chunk_attention if on_cpu else None,
        prefix_attention=_cpu_chunk_attention if on_cpu else None,
        sliding_window=window,
    )


def _cpu_chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """A chunk's attention (its own K/V, or its gathered prefix's too): the C kernel where it
    runs (bf16, AVX512-BF16), else None (the reference's SDPA then)."""
    if not cpu_causal_attention.serves(query, key, value):
        return None
    if sliding_window:
        return cpu_causal_attention.causal_attention(query, key, value, scale, sliding_window=sliding_window)
    return cpu_causal_attention.causal_attention(query, key, value, scale)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    impl = _triton().gather_blocks if use_triton(kv_cache) else reference.gather_blocks_ref
    return impl(kv_cache, block_ids, out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    impl = _triton().scatter_blocks if use_triton(kv_cache) else reference.scatter_blocks_ref
    impl(kv_cache, block_ids, src)


__all__ = [
    "gather_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "scatter_blocks",
    "use_triton",
]
