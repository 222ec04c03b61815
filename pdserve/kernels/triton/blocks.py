"""Triton kernel packing whole KV blocks (all layers) into a contiguous buffer, and back.

In the layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` one block of
all layers is one contiguous run of ``block_numel`` elements, so a gather or scatter is a
batched copy of runs: program ``(i, chunk)`` copies ``CHUNK`` elements of the ``i``-th listed
block. Only the block dimension may be strided; the wrapper checks that each block is dense.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # elements per program: big enough to keep a GPU's memory pipeline busy


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    block_numel,
    stride_src_block,
    stride_dst_block,
    GATHER: tl.constexpr,  # True: cache -> packed buffer; False: packed buffer -> cache
    CHUNK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64)
    block_id = tl.load(block_ids_ptr + index).to(tl.int64)
    if GATHER:
        src_base = block_id * stride_src_block
        dst_base = index * stride_dst_block
    else:
        src_base = index * stride_src_block
        dst_base = block_id * stride_dst_block
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    data = tl.load(src_ptr + src_base + offs, mask=mask)
    tl.store(dst_ptr + dst_base + offs, data.to(dst_ptr.dtype.element_ty), mask=mask)


def _check_dense_blocks(name: str, tensor: torch.Tensor) -> None:
    """Each ``tensor[i]`` must be one contiguous run (only dim 0 may be strided)."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: each block must be contiguous; got strides {tensor.stride()}")
        expected *= size


def launch_copy_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] integer
    packed: torch.Tensor,  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
    gather: bool,
) -> None:
    """Copy the listed blocks cache -> packed (``gather``) or packed -> cache."""
    if tuple(packed.shape) != (block_ids.numel(), *kv_cache.shape[1:]):
        raise ValueError(
            f"packed buffer must be [len(block_ids), *kv_cache.shape[1:]] = "
            f"{(block_ids.numel(), *kv_cache.shape[1:])}; got {tuple(packed.shape)}"
        )
    _check_dense_blocks("kv_cache", kv_cache)
    _check_dense_blocks("packed buffer", packed)
    block_numel = packed[0].numel() if block_ids.numel() else 0
    if block_numel == 0:
        return
    src, dst = (kv_cache, packed) if gather else (packed, kv_cache)
    _copy_blocks_kernel[(block_ids.numel(), triton.cdiv(block_numel, _CHUNK))](
        src,
        dst,
        block_ids,
        block_numel,
        src.stride(0),
        dst.stride(0),
        GATHER=gather,
        CHUNK=_CHUNK,
        num_warps=4,
    )
