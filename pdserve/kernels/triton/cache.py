"""Triton kernel writing new K/V into the paged cache through a slot mapping.

One program per token writes all of that token's KV heads (a ``[heads, head_dim]`` tile) to
``slot // block_size, slot % block_size`` of a layer view. Padding tokens (slot < 0) are
skipped by an early return, so the slots they would map to keep whatever they held. Every
tensor is addressed through its strides: key/value are usually views into a fused QKV output
and the layer view of the cache is not contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,  # cache layer view [num_blocks, 2, block_size, num_kv_heads, head_dim]
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding: leave the cache untouched
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    dst = (
        cache_ptr
        + (slot // block_size) * stride_cb
        + (slot % block_size) * stride_ct
        + offs_h[:, None] * stride_ch
        + offs_d[None, :] * stride_cd
    )
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def launch_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Validate shapes and launch one program per token."""
    if kv_cache_layer.dim() != 5 or kv_cache_layer.shape[1] != 2:
        raise ValueError(
            f"kv_cache_layer must be [blocks, 2, block_size, kv_heads, head_dim]; got {tuple(kv_cache_layer.shape)}"
        )
    expected = (slot_mapping.numel(), *kv_cache_layer.shape[3:])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must be [num_tokens, kv_heads, head_dim] = {expected}; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = kv_cache_layer.shape[3], kv_cache_layer.shape[4]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_layer,
        slot_mapping,
        kv_cache_layer.shape[2],
        *key.stride(),
        *value.stride(),
        *kv_cache_layer.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
