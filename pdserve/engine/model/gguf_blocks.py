"""GGUF's quantized tensors as the blocks the CPU kernels read, without dequantizing them.

Every common kind is held as the file stores it, byte for byte (``kernels/cpu/quant.py``'s
``BlockKind``; the C kernels decode them to exactly the values ``gguf`` dequantizes to):

* ``Q8_0`` as it is: ``d * q`` per 32 weights;
* ``Q4_1`` as it is, ``d * q + m`` per 32 weights, each row's bytes regrouped (all nibbles, then
  all scales, then all minima) for the kernel's vector loads: the same bytes, moved;
* ``Q4_0``, ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K`` and ``Q6_K`` as they are
  (``kernels/cpu/csrc/quants_k.h``).

F32, F16 and BF16 tensors (norms, and any projection a file keeps unquantized) have no blocks:
the loader holds them dense, in ``--dtype``. Rows are whole numbers of blocks, so reordering rows
(llama.cpp's q/k permutation) and stacking them (q, k, v into one projection) work on blocks as
on dense weights.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pdserve.kernels.cpu.quant import BLOCK_SIZE, BlockKind, q4_1_rows_from_blocks

# GGUF types served as blocks, and the kernels' kind for each.
KERNEL_KIND = {
    GGMLQuantizationType.Q8_0: BlockKind.Q8_0,
    GGMLQuantizationType.Q4_1: BlockKind.Q4_1,
    GGMLQuantizationType.Q4_0: BlockKind.Q4_0,
    GGMLQuantizationType.Q5_0: BlockKind.Q5_0,
    GGMLQuantizationType.Q5_1: BlockKind.Q5_1,
    GGMLQuantizationType.Q4_K: BlockKind.Q4_K,
    GGMLQuantizationType.Q5_K: BlockKind.Q5_K,
    GGMLQuantizationType.Q6_K: BlockKind.Q6_K,
}


def to_kernel_blocks(
    tensor_type: GGMLQuantizationType, raw: np.ndarray, rows: int, in_features: int
) -> tuple[BlockKind, torch.Tensor]:
    """A GGUF tensor's bytes (``raw``, ``rows`` rows of ``in_features`` weights) as kernel blocks
    ``[rows, kind.row_bytes(in_features)]`` uint8, and their kind."""
    if tensor_type not in KERNEL_KIND:
        raise ValueError(f"no kernel for GGUF type {tensor_type.name}")
    kind = KERNEL_KIND[tensor_type]
    if in_features % kind.block_weights:
        raise ValueError(f"{tensor_type.name} rows of {in_features} weights are not whole blocks")
    held = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, kind.row_bytes(in_features)).copy())
    if kind is BlockKind.Q4_1:  # the same bytes, regrouped per row
        return kind, q4_1_rows_from_blocks(held.reshape(rows, in_features // BLOCK_SIZE, kind.block_bytes))
    return kind, held  # copied out of the read-only memmap


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
