"""GGUF's quantized tensors as the blocks the CPU kernels read, without dequantizing them.

The kernels (``pdserve.kernels.cpu.quant``) take two layouts, GGUF's own bytes:

* ``Q8_0`` is kept as it is: ``d * q`` per 32 weights.
* ``Q4_1`` is kept as it is, ``d * q + m`` per 32 weights, each row's bytes regrouped (all
  nibbles, then all scales, then all minima) for the kernel's vector loads.
* ``Q4_0`` (``d * (q - 8)``) becomes Q4_1 with ``m = -8 d``: the same numbers (8 d is exact in fp16
  unless it overflows, which ``to_kernel_blocks`` checks).
* ``Q4_K`` (per 256: fp16 ``d``, ``dmin``, eight 6-bit scales and mins; per 32: ``d * sc * q - dmin
  * mn``) becomes Q4_1 with ``d' = fp16(d * sc)`` and ``m' = fp16(-dmin * mn)``. The products need
  up to 17 significant bits and fp16 keeps 11, so this rounds (to nearest even) the scale and
  the minimum of each 32 by at most 2^-11 of themselves (a weight moves by at most 2^-11 of the
  largest in its 32, against the 4-bit step of 1/15 of their range): the only place where
  ``gguf`` mode's weights are not bit for bit the file's.

Any other type (F32, F16, Q6_K, Q5_*, ...) has no kernel here; the loader keeps it dense.
Rows are whole numbers of blocks, so reordering rows (llama.cpp's q/k permutation) and stacking
them (q, k, v into one projection) work on blocks as on dense weights.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pdserve.kernels.cpu.quant import BLOCK_SIZE, BlockKind, q4_1_rows_from_blocks

_Q4_0_BYTES = 18
_Q4_K_BYTES = 144  # per 256 weights
_Q4_K_SUPER = 256

# GGUF types served as blocks, and what the kernels see them as.
KERNEL_KIND = {
    GGMLQuantizationType.Q8_0: BlockKind.Q8_0,
    GGMLQuantizationType.Q4_1: BlockKind.Q4_1,
    GGMLQuantizationType.Q4_0: BlockKind.Q4_1,
    GGMLQuantizationType.Q4_K: BlockKind.Q4_1,
}


def _fp16(values: np.ndarray) -> np.ndarray:
    """fp32 values as fp16 bytes, ``[..., 2]`` uint8."""
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _q4_0_to_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, _Q4_0_BYTES)
    scale = blocks[:, :2].copy().view(np.float16)[:, 0]
    minimum = (scale.astype(np.float32) * -8.0).astype(np.float16)
    if not np.all(np.isfinite(minimum)):
        raise ValueError("Q4_0 block scale too large for Q4_1's fp16 minimum (-8 d overflows)")
    out = np.empty((blocks.shape[0], BlockKind.Q4_1.block_bytes), dtype=np.uint8)
    out[:, 0:2] = blocks[:, 0:2]
    out[:, 2:4] = minimum.view(np.uint8).reshape(-1, 2)
    out[:, 4:] = blocks[:, 2:]
    return out


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``get_scale_min_k4`` for all 8 sub-blocks: ``scales [S, 12]`` -> (sc, mn) ``[S, 8]``."""
    sc = np.empty((scales.shape[0], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4] = scales[:, 0:4] & 63
    mn[:, :4] = scales[:, 4:8] & 63
    sc[:, 4:] = (scales[:, 8:12] & 0x0F) | ((scales[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (scales[:, 8:12] >> 4) | ((scales[:, 4:8] >> 6) << 4)
    return sc, mn


def _q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    supers = raw.reshape(-1, _Q4_K_BYTES)
    d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)  # [S, 1]
    dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _q4_k_scales(supers[:, 4:16])
    scale = d * sc.astype(np.float32)  # [S, 8]
    minimum = -dmin * mn.astype(np.float32)
    qs = supers[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # [S, sub-block, 32]
    out = np.empty((supers.shape[0], 8, BlockKind.Q4_1.block_bytes), dtype=np.uint8)
    out[..., 0:2] = _fp16(scale)
    out[..., 2:4] = _fp16(minimum)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)  # Q4_1: byte j holds weights j and j + 16
    return out.reshape(-1, BlockKind.Q4_1.block_bytes)


def to_kernel_blocks(
    tensor_type: GGMLQuantizationType, raw: np.ndarray, rows: int, in_features: int
) -> tuple[BlockKind, torch.Tensor]:
    """A GGUF tensor's bytes (``raw``, ``rows`` rows of ``in_features`` weights) as kernel blocks
    ``[rows, in_features / 32 * block_bytes]`` uint8, and their kind."""
    if tensor_type not in KERNEL_KIND:
        raise ValueError(f"no kernel for GGUF type {tensor_type.name}")
    if in_features % (_Q4_K_SUPER if tensor_type == GGMLQuantizationType.Q4_K else BLOCK_SIZE):
        raise ValueError(f"{tensor_type.name} rows of {in_features} weights are not whole blocks")
    raw = np.ascontiguousarray(raw).reshape(-1)
    if tensor_type in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        blocks = raw.copy()  # out of the read-only memmap
    elif tensor_type == GGMLQuantizationType.Q4_0:
        blocks = _q4_0_to_q4_1(raw)
    else:
        blocks = _q4_k_to_q4_1(raw)
    kind = KERNEL_KIND[tensor_type]
    held = torch.from_numpy(blocks.reshape(rows, in_features // BLOCK_SIZE, kind.block_bytes))
    if kind is BlockKind.Q4_1:
        return kind, q4_1_rows_from_blocks(held)  # the same bytes, regrouped per row
    return kind, held.reshape(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight [rows, K]`` as Q8_0 blocks (ggml's ``quantize_row_q8_0_ref``: ``d = amax / 127``
    per 32, stored in fp16, ``q = round(w / d)`` with the unrounded ``d``; round half away from
    zero, as ``roundf``)."""
    rows, in_features = weight.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK_SIZE}")
    groups = weight.detach().float().reshape(rows, -1, BLOCK_SIZE)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = groups * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    out = torch.empty(rows, groups.shape[1], BlockKind.Q8_0.block_bytes, dtype=torch.uint8)
    out[..., 0:2] = scale.half().view(torch.uint8).reshape(rows, -1, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(rows, -1)


def permute_block_rows(blocks: torch.Tensor, order: np.ndarray) -> torch.Tensor:
    """Rows of a block tensor in a new order (``blocks[order]``, contiguous)."""
    return blocks[torch.from_numpy(np.ascontiguousarray(order))].contiguous()
