"""The CPU kernels for GGUF-block weights, and their torch reference.

The C kernels are four families of ``kernels/cpu/csrc/`` (``FAMILIES``): ``quants.c``, row-major
blocks against fp32 or bf16 activations; ``quants_a8.c``, against activations quantized to int8;
``repack_a8.c`` and ``repack_bf16.c``, blocks repacked 16 rows at a time, against int8 and bf16
ones. They are built into one library and loaded by ``cpu_build`` (at first use,
``-march=native``, cached per machine); where it cannot be, ``available()`` is False and the
quantized modules fall back to the torch reference here (correct, slower).

Block layouts are GGUF's: ``Q8_0`` as it is (fp16 d, 32 int8: 34 bytes a block of 32 weights);
``Q4_1`` (fp16 d, fp16 m, 16 bytes of nibbles: 20 bytes) with each row's bytes regrouped as
``[every block's 16 nibble bytes][every d][every m]`` (``q4_1_rows_from_blocks``), so that the
kernel loads consecutive blocks' nibbles, and 16 blocks' scales, as one vector each.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum

import numpy as np
import torch

from pdserve.kernels.cpu.build import CLibrary

BLOCK_SIZE = 32


# Weight rows an interleaved group holds (``BlockKind.Q4_1_X16`` / ``Q8_0_X16``).
X16_ROWS = 16


class BlockKind(IntEnum):
    """The block layouts the kernels read (the values are the C side's ``kind``).

    ``Q4_1_X16`` / ``Q8_0_X16``: the same blocks interleaved 16 rows at a time
    (``interleave_rows``; ``kernels/cpu/csrc/repack_a8.c`` has the layout), which the int8-activation
    kernel and the bf16 one (``kernels/cpu/csrc/repack_bf16.c``) multiply; the dequantization decodes
    both. Made at load for ``--quantization gguf-a8 / int8-a8`` where the CPU has AVX512-VNNI
    (``x16_route``), and for a bf16 model's block-held projections and LM head where it has
    AVX512-BF16 (``bf16_x16_route``).
    """

    Q4_1 = 0
    Q8_0 = 1
    Q4_1_X16 = 2
    Q8_0_X16 = 3
    # Held exactly as GGUF stores them, block after block (``kernels/cpu/csrc/quants_k.h``).
    Q4_0 = 4
    Q5_0 = 5
    Q5_1 = 6
    Q4_K = 7
    Q5_K = 8
    Q6_K = 9
    # GGUF's Q4_0, Q5_0, Q5_1 and Q4_K interleaved 16 rows at a time, for the int8-activation kernel only
    # (``kernels/cpu/csrc/repack_a8.c``): made at load with ``-a8`` where the CPU has AVX512-VNNI.
    Q4_0_X16 = 10
    Q5_0_X16 = 11
    Q5_1_X16 = 12
    Q4_K_X16 = 13

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (of ``block_weights`` weights)."""
        return _BLOCK_BYTES[self.plain]

    @property
    def block_weights(self) -> int:
        """Weights one block holds: 256 for the K-quants, 32 for the others."""
        return 256 if self.plain in (BlockKind.Q4_K, BlockKind.Q5_K, BlockKind.Q6_K) else BLOCK_SIZE

    def row_bytes(self, in_features: int) -> int:
        """Bytes of a row of ``in_features`` weights."""
        return in_features // self.block_weights * self.block_bytes

    @property
    def interleaved(self) -> bool:
        return self in _PLAIN_OF

    @property
    def as_gguf(self) -> bool:
        """Held exactly as GGUF stores them (``Q4_0`` ... ``Q6_K``)."""
        return BlockKind.Q4_0 <= self <= BlockKind.Q6_K

    @property
    def plain(self) -> BlockKind:
        """The row-major kind holding the same blocks."""
        return _PLAIN_OF.get(self, self)

    def interleaved_twin(self, int8_activations: bool) -> BlockKind | None:
        """The kind holding these blocks interleaved 16 rows at a time for the kernels of these
        activations (Q4_1 and Q8_0: int8 and bf16; Q4_0, Q5_0, Q5_1, Q4_K: int8 only), or None."""
        twin = _TWIN_OF.get(self)
        if twin is None or (not int8_activations and twin in _INT8_ONLY):
            return None
        return twin


_PLAIN_OF = {
    BlockKind.Q4_1_X16: BlockKind.Q4_1,
    BlockKind.Q8_0_X16: BlockKind.Q8_0,
    BlockKind.Q4_0_X16: BlockKind.Q4_0,
    BlockKind.Q5_0_X16: BlockKind.Q5_0,
    BlockKind.Q5_1_X16: BlockKind.Q5_1,
    BlockKind.Q4_K_X16: BlockKind.Q4_K,
}
_TWIN_OF = {plain: twin for twin, plain in _PLAIN_OF.items()}
_INT8_ONLY = (BlockKind.Q4_0_X16, BlockKind.Q5_0_X16, BlockKind.Q5_1_X16, BlockKind.Q4_K_X16)


_BLOCK_BYTES = {
    BlockKind.Q4_1: 20,
    BlockKind.Q8_0: 34,
    BlockKind.Q4_0: 18,
    BlockKind.Q5_0: 22,
    BlockKind.Q5_1: 24,
    BlockKind.Q4_K: 144,
    BlockKind.Q5_K: 176,
    BlockKind.Q6_K: 210,
}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_quant_matmul.argtypes = [cint, ptr, cint, i64, i64, ptr, i64, ptr, cint, cint]
    lib.pd_quant_matmul.restype = cint
    lib.pd_quant_dequant.argtypes = [cint, ptr, i64, ptr, i64, ptr, cint, cint]
    lib.pd_quant_dequant.restype = None
    lib.pd_quant_matmul_a8.argtypes = [cint, ptr, cint, i64, i64, ptr, i64, ptr, cint, cint]
    lib.pd_quant_matmul_a8.restype = cint
    lib.pd_quant_k_route.argtypes = []
    lib.pd_quant_k_route.restype = cint
    lib.pd_repack_a8_route.argtypes = []
    lib.pd_repack_a8_route.restype = cint
    lib.pd_repack_bf16_route.argtypes = []
    lib.pd_repack_bf16_route.restype = cint


# The families of kernels this library links (build.sources): row-major blocks against float and
# int8 activations, the kinds held as GGUF stores them, and blocks repacked 16 rows at a time
# against int8 and bf16 ones.
FAMILIES = ("quants", "quants_a8", "quants_k", "quants_k_a8", "repack_a8", "repack_bf16")
KERNELS = CLibrary(FAMILIES, _declare, "quantized-weight matmuls")


def library() -> ctypes.CDLL:
    """The loaded kernels (built on first call); raises ``RuntimeError`` when they cannot be."""
    return KERNELS.load()


def available() -> bool:
    """True when the C kernels build and load here (logged once, why they do not)."""
    return KERNELS.available()


def k_route() -> bool:
    """True when the kinds held as GGUF stores them (``BlockKind.as_gguf``) run vector kernels for
    float activations here (AVX-512); elsewhere their plain C loops are correct and 30-80x slower,
    so the loader keeps those tensors dense."""
    return available() and bool(library().pd_quant_k_route())


def int8_dot_route() -> bool:
    """True when int8 activations run native int8 dot products here (AVX512-VNNI's vpdpbusd): the
    CPUs where ``-a8`` is the default (``loader.resolve_quantization``)."""
    return available() and bool(library().pd_repack_a8_route())


def x16_route() -> bool:
    """True when the interleaved kinds run a vector kernel here (AVX512-VNNI), so that the loader
    interleaves only where that pays (elsewhere their plain C loop is correct, and slow)."""
    return int8_dot_route()


def bf16_x16_route() -> bool:
    """True when the interleaved kinds against bf16 activations run a vector kernel here
    (AVX512-BF16: ``kernels/cpu/csrc/repack_bf16.c``), so that a bf16 model's block-held projections and
    LM head are interleaved only where that pays."""
    return available() and bool(library().pd_repack_bf16_route())


def check_blocks(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> None:
    """Raise ``ValueError`` unless ``blocks`` are contiguous uint8 rows of ``in_features`` weights
    (for an interleaved kind, a multiple of 16 rows)."""
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.dim() != 2:
        raise ValueError("weight blocks must be a contiguous 2-D uint8 tensor")
    if in_features % kind.block_weights:
        raise ValueError(f"in_features {in_features} is not a multiple of {kind.block_weights}")
    if blocks.shape[-1] != kind.row_bytes(in_features):
        raise ValueError(f"{kind.name} rows of {blocks.shape[-1]} bytes do not hold {in_features} weights")
    if kind.interleaved and blocks.shape[0] % X16_ROWS:
        raise ValueError(f"{kind.name} holds a multiple of {X16_ROWS} rows, not {blocks.shape[0]}")


def quant_matmul(
    x: torch.Tensor,
    kind: BlockKind,
    blocks: torch.Tensor,
    in_features: int,
    checked: bool = False,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``W`` held as ``blocks [N, K / 32 * block_bytes]``; same dtype as x.

    ``checked``: the blocks were validated when their holder was made (``QuantLinear``), so the
    per-step call skips it (at one row the Python around the kernel is a fifth of its time).
    ``int8_activations``: x is quantized to int8 per block of 32 first (llama.cpp's Q8_1, see
    ``kernels/cpu/csrc/quants_a8.c``; ``quant_matmul_a8_ref`` says what it computes)."""
    if not checked:
        check_blocks(kind, blocks, in_features)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activations must be float32 or bfloat16, not {x.dtype}")
    x = x.contiguous()
    rows, out_features = x.shape[0], blocks.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    is_bf16 = int(x.dtype == torch.bfloat16)
    matmul = library().pd_quant_matmul_a8 if int8_activations else library().pd_quant_matmul
    status = matmul(
        int(kind),
        x.data_ptr(),
        is_bf16,
        rows,
        in_features,
        blocks.data_ptr(),
        out_features,
        out.data_ptr(),
        is_bf16,
        torch.get_num_threads(),
    )
    if status == -2:  # the kernel's own word on which kinds take which activations
        taken = "int8" if kind in _INT8_ONLY else "int8 or bf16"
        raise ValueError(
            f"{kind.name} blocks are multiplied with {taken} activations only, not {x.dtype} ones"
        )
    if status:
        raise MemoryError("quantized matmul: its buffers could not be allocated")
    return out


def quant_dequantize(
    kind: BlockKind,
    blocks: torch.Tensor,
    in_features: int,
    dtype: torch.dtype,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W[rows]`` (every row when ``rows`` is None) decoded to ``dtype`` (float32 or bfloat16),
    into ``out`` when given (a reused buffer: a fresh tensor of a whole matrix page-faults its
    memory in on every prefill chunk)."""
    check_blocks(kind, blocks, in_features)
    index = None if rows is None else rows.to(torch.int64).contiguous()
    count = blocks.shape[0] if index is None else index.numel()
    if index is not None and count and (int(index.min()) < 0 or int(index.max()) >= blocks.shape[0]):
        raise IndexError(f"row index out of range for {blocks.shape[0]} rows")
    if out is None:
        out = torch.empty(count, in_features, dtype=dtype)
    elif out.shape != (count, in_features) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {(count, in_features)}")
    library().pd_quant_dequant(
        int(kind),
        blocks.data_ptr(),
        in_features,
        None if index is None else index.data_ptr(),
        count,
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


# --- torch reference: what the kernels compute, written for clarity (tests and no-compiler hosts) ---


def _block_parts(
    kind: BlockKind, blocks: torch.Tensor, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [rows, blocks, 32], d [rows, blocks], m [rows, blocks])`` in fp32: each block's
    integers, scale and minimum (0 for Q8_0), so that ``w = d * q + m``."""
    check_blocks(kind, blocks, in_features)
    if kind.interleaved:
        kind, blocks = kind.plain, deinterleave_rows(kind, blocks, in_features)
    rows, num_blocks = blocks.shape[0], in_features // BLOCK_SIZE
    if kind is BlockKind.Q4_1:
        nibbles = blocks[:, : in_features // 2].reshape(rows, num_blocks, 16).to(torch.int32)
        scales = blocks[:, in_features // 2 :].contiguous().view(torch.float16).float()
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
        return q, scales[:, :num_blocks], scales[:, num_blocks:]
    per_block = blocks.view(rows, num_blocks, kind.block_bytes)
    scale = per_block[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    q = per_block[..., 2:].contiguous().view(torch.int8).float()
    return q, scale, torch.zeros_like(scale)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 at the last axis's byte pairs, as float64."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float64)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``get_scale_min_k4`` for all 8 sub-blocks: ``scales [..., 12]`` -> (sc, mn) ``[..., 8]``."""
    sc = np.concatenate(
        [scales[..., 0:4] & 63, (scales[..., 8:12] & 15) | ((scales[..., 0:4] >> 6) << 4)], -1
    )
    mn = np.concatenate(
        [scales[..., 4:8] & 63, (scales[..., 8:12] >> 4) | ((scales[..., 4:8] >> 6) << 4)], -1
    )
    return sc.astype(np.float64), mn.astype(np.float64)


def gguf_sub_block_parts(
    kind: BlockKind, blocks: torch.Tensor, in_features: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q [rows, subs, 32], d [rows, subs, 2], m [rows, subs, 2])`` of a kind held as GGUF
    stores it, in float64: ``w[j] = d[j // 16] * q[j] + m[j // 16]`` per 32 weights, the decoding
    of ``kernels/cpu/csrc/quants_k.h`` written with numpy (each d and m exact)."""
    check_blocks(kind, blocks, in_features)
    rows, subs = blocks.shape[0], in_features // BLOCK_SIZE
    raw = blocks.numpy().reshape(rows, -1, kind.block_bytes)
    if kind in (BlockKind.Q4_0, BlockKind.Q5_0, BlockKind.Q5_1):
        d = _fp16(raw[..., 0:2])[..., 0]
        offset = {BlockKind.Q4_0: 2, BlockKind.Q5_0: 6, BlockKind.Q5_1: 8}[kind]
        qs = raw[..., offset : offset + 16]
        q = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
        if kind is not BlockKind.Q4_0:
            qh = raw[..., offset - 4 : offset].copy().view("<u4").astype(np.int64)  # [rows, subs, 1]
            q |= ((qh >> np.arange(32)) & 1) << 4
        m = (
            _fp16(raw[..., 2:4])[..., 0]
            if kind is BlockKind.Q5_1
            else d * (-8.0 if kind is BlockKind.Q4_0 else -16.0)
        )
        return q.astype(np.float64), np.repeat(d[..., None], 2, -1), np.repeat(m[..., None], 2, -1)
    supers = raw.shape[1]
    if kind is BlockKind.Q6_K:
        ql, qh = (
            raw[..., 0:128].reshape(rows, supers, 2, 2, 32),
            raw[..., 128:192].reshape(rows, supers, 2, 1, 32),
        )
        scales = raw[..., 192:208].copy().view(np.int8).astype(np.float64).reshape(rows, supers, 2, 4, 2)
        d = _fp16(raw[..., 208:210])  # [rows, supers, 1]
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [rows, supers, half, t (0-3), 32]
        high = (qh >> (2 * np.arange(4))[:, None]) & 3
        q = (low | (high << 4)).astype(np.float64).reshape(rows, subs, 32)
        dh = (d[..., None, None] * scales).reshape(rows, subs, 2)
        return q, dh, -32.0 * dh
    d, dmin = _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4])  # [rows, supers, 1]
    sc, mn = _k_scale_min(raw[..., 4:16])
    qs = raw[..., 16:144] if kind is BlockKind.Q4_K else raw[..., 48:176]
    qs = qs.reshape(rows, supers, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, supers, 8, 32).astype(np.int64)
    if kind is BlockKind.Q5_K:
        qh = raw[..., 16:48].astype(np.int64)  # [rows, supers, 32]
        q |= ((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4
    dh = np.repeat((d * sc).reshape(rows, subs, 1), 2, -1)
    mh = np.repeat((-(dmin * mn)).reshape(rows, subs, 1), 2, -1)
    return q.astype(np.float64).reshape(rows, subs, 32), dh, mh


def dequantize_ref(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``W`` in fp32 from its blocks: Q4_1 ``d * q + m``, Q8_0 ``d * q``; the kinds held as GGUF
    stores them ``d * q + m`` per 16 rounded once (the values ggml and the gguf package give)."""
    if kind.interleaved and kind.plain.as_gguf:
        kind, blocks = kind.plain, deinterleave_rows(kind, blocks, in_features)
    if kind.as_gguf:
        k_q, k_d, k_m = gguf_sub_block_parts(kind, blocks, in_features)
        rows = blocks.shape[0]
        halves = k_q.reshape(rows, -1, 2, 16) * k_d[..., None] + k_m[..., None]  # exact in float64
        return torch.from_numpy(halves.astype(np.float32).reshape(rows, in_features))
    q, scale, minimum = _block_parts(kind, blocks, in_features)
    weights = q * scale[..., None] if kind is BlockKind.Q8_0 else q * scale[..., None] + minimum[..., None]
    return weights.reshape(blocks.shape[0], in_features)


def q4_1_rows_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks ``[rows, num_blocks, 20]`` (d, m, 16 nibble bytes) as the kernel's rows:
    ``[rows, num_blocks * 20]`` holding every nibble byte, then every d, then every m."""
    rows = blocks.shape[0]
    return torch.cat(
        [
            blocks[..., 4:].reshape(rows, -1),
            blocks[..., 0:2].reshape(rows, -1),
            blocks[..., 2:4].reshape(rows, -1),
        ],
        dim=1,
    ).contiguous()


# GGUF's blocks as the interleaved layout regroups them: byte ranges of each part of a block, in
# the order a chunk holds them (repack_a8.c's header). A part of 4n bytes goes as n words, each
# a vector of the 16 rows' 4 bytes; an fp16 (d, m, dmin) as the 16 rows' values.
_GGUF_PARTS = {
    BlockKind.Q4_0: {"qs": (2, 18), "d": (0, 2)},
    BlockKind.Q5_0: {"qs": (6, 22), "qh": (2, 6), "d": (0, 2)},
    BlockKind.Q5_1: {"qs": (8, 24), "qh": (4, 8), "d": (0, 2), "m": (2, 4)},
    BlockKind.Q4_K: {"qs": (16, 144), "scales": (4, 16), "d": (0, 2), "dmin": (2, 4)},
}


def _unit(width: int) -> int:
    """Bytes of a part a row puts in one vector of 16 rows: 4 (words) or 2 (an fp16)."""
    return 4 if width % 4 == 0 else 2


def _gguf_chunks(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """A GGUF kind's rows as chunks ``[groups, blocks, 16 * block_bytes]``: per (16-row group,
    block) each part of its 16 rows' blocks (``_GGUF_PARTS``), 16 rows' pieces a vector."""
    rows, num_blocks = blocks.shape[0], in_features // kind.block_weights
    groups = rows // X16_ROWS
    per_block = blocks.reshape(groups, X16_ROWS, num_blocks, kind.block_bytes)
    pieces = []
    for first, last in _GGUF_PARTS[kind].values():
        unit = _unit(last - first)
        part = per_block[..., first:last].reshape(groups, X16_ROWS, num_blocks, (last - first) // unit, unit)
        pieces.append(part.permute(0, 2, 3, 1, 4).reshape(groups, num_blocks, -1))  # [g, b, piece, 16, unit]
    return torch.cat(pieces, dim=-1)


def _gguf_rows(kind: BlockKind, chunks: torch.Tensor, rows: int, in_features: int) -> torch.Tensor:
    """``_gguf_chunks`` undone: the GGUF kind's rows ``[rows, row_bytes]``."""
    num_blocks, groups = in_features // kind.block_weights, rows // X16_ROWS
    chunks = chunks.reshape(groups, num_blocks, -1)
    per_block = torch.empty(groups, X16_ROWS, num_blocks, kind.block_bytes, dtype=torch.uint8)
    at = 0
    for first, last in _GGUF_PARTS[kind].values():
        width, unit = last - first, _unit(last - first)
        part = chunks[..., at : at + width * X16_ROWS].reshape(
            groups, num_blocks, width // unit, X16_ROWS, unit
        )
        per_block[..., first:last] = part.permute(0, 3, 1, 2, 4).reshape(groups, X16_ROWS, num_blocks, width)
        at += width * X16_ROWS
    return per_block.reshape(rows, -1).contiguous()


def _chunks(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain kind's rows as ``(words [groups, blocks, words, 16, 4], scales [groups, blocks,
    2 or 1, 16, 2])``: the 4-byte pieces of each (16-row group, block) and its fp16 d (and m)."""
    rows, num_blocks = blocks.shape[0], in_features // BLOCK_SIZE
    groups = rows // X16_ROWS
    if kind is BlockKind.Q4_1:
        nibbles = blocks[:, : in_features // 2].reshape(groups, X16_ROWS, num_blocks, 4, 4)
        scales = blocks[:, in_features // 2 :].reshape(groups, X16_ROWS, 2, num_blocks, 2)
        return nibbles.permute(0, 2, 3, 1, 4), scales.permute(0, 3, 2, 1, 4)
    per_block = blocks.reshape(groups, X16_ROWS, num_blocks, kind.block_bytes)
    weights = (per_block[..., 2:] ^ 0x80).reshape(groups, X16_ROWS, num_blocks, 8, 4)  # plus 128
    return weights.permute(0, 2, 3, 1, 4), per_block[..., :2].reshape(
        groups, X16_ROWS, num_blocks, 1, 2
    ).permute(0, 2, 3, 1, 4)


def interleave_rows(
    kind: BlockKind, blocks: torch.Tensor, in_features: int
) -> tuple[BlockKind, torch.Tensor]:
    """``(KIND_X16, blocks)``: the rows of a plain kind (Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, Q4_K) interleaved 16
    at a time, as ``kernels/cpu/csrc/repack_a8.c`` lays them out; the same bytes (Q8_0's weights plus
    128), moved: ``[rows, row_bytes]`` as before, so sizes and row counts read the same."""
    check_blocks(kind, blocks, in_features)
    if kind.interleaved:
        raise ValueError(f"{kind.name} blocks are interleaved already")
    twin = kind.interleaved_twin(int8_activations=True)
    if twin is None:
        raise ValueError(f"{kind.name} blocks have no interleaved layout")
    if blocks.shape[0] % X16_ROWS:
        raise ValueError(f"interleaving needs a multiple of {X16_ROWS} rows, not {blocks.shape[0]}")
    if kind.as_gguf:
        return twin, _gguf_chunks(kind, blocks, in_features).reshape(blocks.shape).contiguous()
    words, scales = _chunks(kind, blocks, in_features)
    groups, num_blocks = words.shape[0], words.shape[1]
    chunk = torch.cat([words.reshape(groups, num_blocks, -1), scales.reshape(groups, num_blocks, -1)], dim=-1)
    return twin, chunk.reshape(blocks.shape).contiguous()


def deinterleave_rows(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``interleave_rows`` undone: the plain kind's rows of an interleaved matrix."""
    plain, rows, num_blocks = kind.plain, blocks.shape[0], in_features // BLOCK_SIZE
    if plain.as_gguf:
        return _gguf_rows(plain, blocks, rows, in_features)
    groups = rows // X16_ROWS
    word_count, scale_count = (4, 2) if plain is BlockKind.Q4_1 else (8, 1)
    chunk = blocks.reshape(groups, num_blocks, -1)
    words = chunk[..., : word_count * 64].reshape(groups, num_blocks, word_count, X16_ROWS, 4)
    scales = chunk[..., word_count * 64 :].reshape(groups, num_blocks, scale_count, X16_ROWS, 2)
    words, scales = words.permute(0, 3, 1, 2, 4), scales.permute(0, 3, 2, 1, 4)  # [g, 16, ...]
    if plain is BlockKind.Q4_1:
        return torch.cat(
            [words.reshape(rows, -1), scales.reshape(rows, -1)], dim=1
        ).contiguous()  # [nibbles][d][m] per row
    per_block = torch.cat(
        [
            scales.reshape(groups, X16_ROWS, num_blocks, 2),
            (words ^ 0x80).reshape(groups, X16_ROWS, num_blocks, 32),
        ],
        dim=-1,
    )
    return per_block.reshape(rows, -1).contiguous()


def quant_matmul_ref(
    x: torch.Tensor, kind: BlockKind, blocks: torch.Tensor, in_features: int
) -> torch.Tensor:
    """``quant_matmul`` by dequantizing to fp32 and one fp32 matmul."""
    return (x.float() @ dequantize_ref(kind, blocks, in_features).T).to(x.dtype)


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, d, s)``: x ``[M, K]`` per block of 32 as ``int8_activations`` quantizes it: ``d =
    max|x| / 127``, ``q = round(x * (1 / d))`` (ties to even; 0 where d is 0), ``s = d * sum(q)``;
    q ``[M, K / 32, 32]``, d and s ``[M, K / 32]``, all fp32."""
    values = x.float().reshape(x.shape[0], -1, BLOCK_SIZE)
    scale = values.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(values * inverse[..., None])
    return q, scale, scale * q.sum(dim=-1)


def quant_matmul_a8_ref(
    x: torch.Tensor, kind: BlockKind, blocks: torch.Tensor, in_features: int
) -> torch.Tensor:
    """``quant_matmul(..., int8_activations=True)`` in float64: ``sum_b dw d (q . xq) + m s`` per
    block (m: Q4_1's minimum, 0 for Q8_0), every product exact but the last rounding."""
    q, scale, q_sum = (t.double() for t in quantize_activations_ref(x))
    if kind.interleaved and kind.plain.as_gguf:
        kind, blocks = kind.plain, deinterleave_rows(kind, blocks, in_features)
    if kind.as_gguf:  # per half of 32: d q . xq + m sum(xq), times x's scale
        k_q, k_d, k_m = (torch.from_numpy(t) for t in gguf_sub_block_parts(kind, blocks, in_features))
        halves = q.reshape(q.shape[0], q.shape[1], 2, 16)
        dots = torch.einsum("mbhj,nbhj->mnbh", halves, k_q.reshape(*k_q.shape[:2], 2, 16))
        sums = halves.sum(-1)  # [M, blocks, 2]
        per_block = (dots * k_d[None]).sum(-1) + (sums[:, None] * k_m[None]).sum(-1)
        return (per_block * scale[:, None]).sum(-1).to(x.dtype)
    weight_q, weight_d, weight_m = (t.double() for t in _block_parts(kind, blocks, in_features))
    dots = torch.einsum("mbj,nbj->mnb", q, weight_q)  # exact integers
    out = (dots * weight_d[None] * scale[:, None]).sum(-1) + (weight_m[None] * q_sum[:, None]).sum(-1)
    return out.to(x.dtype)
