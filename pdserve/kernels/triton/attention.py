"""Triton paged attention: one kernel for decode and for prefill/extend chunks.

Both are "a chunk of query tokens attending causally to a paged context": a decode is a chunk
of one token at position ``seq_len - 1``. So one kernel serves both, and decode only differs by
skipping the search for its sequence (``IS_DECODE``: program ``i`` is sequence ``i``).

A program owns one query tile of one sequence for one KV head and *all* query heads that share
it (GQA). Its ``BLOCK_M`` rows are ``BLOCK_Q`` tokens x ``GROUP_PAD`` heads, so every K/V byte of
that head is read once per tile rather than once per query head; decode, which is bound by
reading the cache, reads it exactly once. Rows are padded to at least 16 because ``tl.dot``
needs it on GPUs; padded rows are masked on the store.

The context is walked in tiles of ``BLOCK_N`` token positions, independent of the cache's block
size: each position looks up its physical block in the block table. That keeps ``BLOCK_N`` a
power of two whatever the block size, and lets the kernel take any strides (a layer view of the
cache is not contiguous). Softmax is online (running max and sum per row), in fp32.

A decode batch too small to fill a GPU (few sequences x KV heads) is also split along the
context (flash-decoding): each program then covers one ``PARTITION`` of positions and leaves its
unnormalized state (accumulator, running max and sum), which ``_combine_partitions_kernel``
rescales to the global max and sums.

A sliding window ``W`` (``SLIDING``, ``window``: the query at ``p`` sees ``p - W < k <= p``, the
reference's mask) starts each program at its tile's first row's first visible position, so
blocks before it are never read, and masks each row's earlier positions; a split decode's
partitions before the window do nothing. Without one (``SLIDING`` False) the kernel is the
same as before.

All arithmetic is fp32: K/V/Q are converted right after loading. This is also what makes the
kernel testable: Triton's CPU interpreter does not compute bf16 arithmetic or ``tl.dot`` on bf16
correctly. The dots use ``ieee`` precision for fp32 caches (to meet fp32 accuracy) and ``tf32``
otherwise: bf16 values are exact in tf32, so with a bf16 query Q.K^T loses nothing (the scale
is applied after the dot for that reason) and only the probabilities are rounded, to 10
mantissa bits, better than the bf16 a fused bf16 kernel would use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_DOT_ROWS = 16  # tl.dot's smallest M/N/K on NVIDIA GPUs
_MAX_BLOCK_N = 64  # context positions per tile
_PREFILL_ROWS = 64  # target rows (tokens x heads of a group) of a prefill tile
_DECODE_PARTITION = 256  # context positions per program when a decode is split
_FILL_PROGRAMS = 512  # (sequence, KV head) programs that keep a large GPU busy without a split


def _block_n(block_d: int, fp32_cache: bool) -> int:
    """Context positions per tile, smaller for wide heads so a tile fits in shared memory.

    fp32 dots stage their operands in shared memory: a 64-row prefill tile of head_dim 128 with
    64 positions needs ~115 KB on sm_80, more than the 99 KB of sm_86/sm_89 GPUs. With these
    sizes the tests compile the kernel for sm_80 and check it stays within 99 KB.
    """
    budget = 4096 if fp32_cache else 8192  # positions x head_dim
    return min(_MAX_BLOCK_N, max(_MIN_DOT_ROWS, budget // block_d))


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global tile ``tile``.

    Sequence ``s`` owns the tiles numbered from ``query_start_loc[s] // BLOCK_Q + s``: that
    numbering leaves every sequence room for ``cdiv(q_len, BLOCK_Q)`` tiles (and an empty one
    for an empty chunk) without reading the chunk lengths on the host, and needs at most
    ``num_tokens // BLOCK_Q + num_seqs`` tiles in all.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,  # split decode only: [num_seqs, num_heads, num_partitions, BLOCK_D] fp32
    part_stats_ptr,  # split decode only: [num_seqs, num_heads, num_partitions, 2] fp32 (max, sum)
    scale_log2e,  # softmax scale * log2(e): scores are exponentiated with exp2
    window,  # SLIDING only: the sliding window W (a row at p sees p - W < k <= p)
    num_seqs,
    num_heads,
    num_partitions,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,  # cache layer view [num_blocks, 2, block_size, num_kv_heads, head_dim]
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PARTITION: tl.constexpr = 0,  # > 0: program_id(2) takes this many context positions (decode)
    SLIDING: tl.constexpr = False,  # mask (and skip) positions outside each row's window
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    if IS_DECODE:
        seq = tile
        q_start = tile
        q_len = 1
        q_tile = 0
    else:
        seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile = tile - (q_start // BLOCK_Q + seq)
        if q_tile * BLOCK_Q >= q_len:
            return  # a spare tile (see _find_seq) or an empty chunk

    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the chunk's first query token
    # The tile's last row attends to positions < kv_end; later positions are never read.
    if IS_DECODE:
        kv_end = seq_len
    else:
        kv_end = first_pos + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    if PARTITION > 0:
        part = tl.program_id(2)
        kv_start = part * PARTITION
        kv_end = tl.minimum(kv_end, kv_start + PARTITION)  # may be <= kv_start: nothing to read
    else:
        part = 0
        kv_start = 0
    if SLIDING:  # nothing before the window of the tile's first (earliest) row is read
        kv_start = tl.maximum(first_pos + q_tile * BLOCK_Q - window + 1, kv_start)

    rows = tl.arange(0, BLOCK_M)
    row_tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # token index within the chunk
    row_head = rows % GROUP_PAD  # head index within the group
    row_valid = (row_tok < q_len) & (row_head < GROUP)
    row_pos = first_pos + row_tok
    head = kv_head * GROUP + row_head
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + row_tok).to(tl.int64)

    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    head_base = kv_ptr + kv_head.to(tl.int64) * stride_ch

    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_end
        block = tl.load(table_row + (pos // block_size) * stride_btb, mask=pos_valid, other=0)
        slot_off = block.to(tl.int64) * stride_cb + (pos % block_size).to(tl.int64) * stride_ct
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        kv_off = slot_off[:, None] + offs_d[None, :] * stride_cd  # [BLOCK_N, BLOCK_D]
        k = tl.load(head_base + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(head_base + stride_ckv + kv_off, mask=kv_mask, other=0.0).to(tl.float32)

        # Scaled after the dot, not folded into q, so a bf16 q stays exact in a tf32 dot.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= row_pos[:, None]) & pos_valid[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Without a window a real row sees the first position of its first tile (position 0, or
        # the partition's first one, all visible to a decode), so m_new is finite for it; the
        # guard keeps padded rows, empty partitions and (with a window) rows whose window starts
        # after this tile free of inf - inf = NaN: they keep m = -inf and a zero sum and
        # accumulator until a tile they see (their own position is always in a later one).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if PARTITION > 0:  # leave the partition's unnormalized state to _combine_partitions_kernel
        part_row = (seq * num_heads + head).to(tl.int64) * num_partitions + part
        tl.store(part_acc_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_stats_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_stats_ptr + part_row * 2 + 1, l_i, mask=row_valid)
        return
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


@triton.jit
def _combine_partitions_kernel(
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    num_heads,
    num_partitions,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # num_partitions rounded up to a power of two
):
    """Merge one (sequence, head)'s partition states: rescale each to the global max, then sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    part_valid = parts < num_partitions
    part_row = (seq * num_heads + head).to(tl.int64) * num_partitions + parts
    m = tl.load(part_stats_ptr + part_row * 2, mask=part_valid, other=float("-inf"))
    l = tl.load(part_stats_ptr + part_row * 2 + 1, mask=part_valid, other=0.0)  # noqa: E741
    # The partition holding the last position is never empty (nor is partition 0 without a
    # window), so the max is finite; empty partitions get weight 0.
    weight = tl.exp2(m - tl.max(m, axis=0))
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :],
        mask=part_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def attention_constexprs(group: int, head_dim: int, is_decode: bool, cache_dtype: torch.dtype) -> dict:
    """The kernel's compile-time parameters for one shape (also used to compile it ahead of time)."""
    group_pad = triton.next_power_of_2(group)
    block_d = max(triton.next_power_of_2(head_dim), _MIN_DOT_ROWS)
    # Decode has one token per sequence: its rows are the group's heads, padded to what tl.dot
    # accepts. Prefill tiles take several tokens so a K/V tile is reused across more rows
    # (fewer for head_dim 256, whose fp32 query tile alone would take 64 KB of shared memory).
    rows = _MIN_DOT_ROWS if is_decode else _PREFILL_ROWS if block_d <= 128 else _PREFILL_ROWS // 2
    block_q = max(1, rows // group_pad)
    fp32_cache = cache_dtype == torch.float32
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": block_q,
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_N": _block_n(block_d, fp32_cache),
        "IS_DECODE": is_decode,
        "DOT_PRECISION": "ieee" if fp32_cache else "tf32",
    }


def _check_shapes(query: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor) -> int:
    """Validate the shared arguments; return the GQA group size."""
    if query.dim() != 3 or kv_cache_layer.dim() != 5 or kv_cache_layer.shape[1] != 2:
        raise ValueError(
            "query must be [tokens, heads, head_dim] and kv_cache_layer "
            f"[blocks, 2, block_size, kv_heads, head_dim]; got {tuple(query.shape)}, "
            f"{tuple(kv_cache_layer.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache_layer.shape[3]
    if head_dim != kv_cache_layer.shape[4]:
        raise ValueError(f"head_dim: query has {head_dim}, kv_cache_layer {kv_cache_layer.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks]; got {tuple(block_tables.shape)}")
    return num_heads // num_kv_heads


def decode_partitions(num_seqs: int, num_kv_heads: int, max_positions: int, partition_size: int) -> int:
    """Into how many context partitions each (sequence, KV head) decode program is split.

    A decode launches one program per (sequence, KV head): at batch 32 with 3 KV heads that is
    96 programs, too few to keep a GPU's memory system busy, so long contexts are split into
    partitions of ``partition_size`` positions processed in parallel and merged afterwards
    (flash-decoding). ``max_positions`` is the block tables' capacity, known on the host
    without reading ``seq_lens`` back from the GPU; partitions past a sequence's end do no work.
    """
    if num_seqs * num_kv_heads >= _FILL_PROGRAMS:
        return 1
    return max(1, triton.cdiv(max_positions, partition_size))


def launch_paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor | None,  # None: decode, one token per sequence
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    partition_size: int = _DECODE_PARTITION,
    sliding_window: int = 0,  # W > 0: each row sees its last W positions only
) -> torch.Tensor:
    """Run the kernel into ``out`` (same shape as ``query``); shapes validated here."""
    group = _check_shapes(query, kv_cache_layer, block_tables)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache_layer.shape[3], kv_cache_layer.shape[2]
    num_seqs = seq_lens.numel()
    if out.shape != query.shape:
        raise ValueError(f"out: expected shape {tuple(query.shape)}, got {tuple(out.shape)}")
    is_decode = query_start_loc is None
    if is_decode and num_seqs != num_tokens:
        raise ValueError(f"decode: seq_lens has {num_seqs} entries for {num_tokens} query tokens")
    if query_start_loc is not None and query_start_loc.numel() != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got {query_start_loc.numel()}"
        )
    if num_tokens == 0 or num_seqs == 0:
        return out

    constexprs = attention_constexprs(group, head_dim, is_decode, kv_cache_layer.dtype)
    num_partitions = 1
    if is_decode:
        grid: tuple[int, ...] = (num_seqs, num_kv_heads)
        query_start_loc = seq_lens  # unused by the kernel; any tensor will do
        max_positions = block_tables.shape[1] * block_size
        num_partitions = decode_partitions(num_seqs, num_kv_heads, max_positions, partition_size)
    else:
        grid = (num_tokens // constexprs["BLOCK_Q"] + num_seqs, num_kv_heads)
    if sliding_window:
        constexprs["SLIDING"] = True
    part_acc = part_stats = out  # placeholders unless split
    if num_partitions > 1:
        grid = (*grid, num_partitions)
        constexprs["PARTITION"] = partition_size
        state = (num_seqs, num_heads, num_partitions)
        part_acc = torch.empty((*state, constexprs["BLOCK_D"]), dtype=torch.float32, device=out.device)
        part_stats = torch.empty((*state, 2), dtype=torch.float32, device=out.device)
    _paged_attention_kernel[grid](
        out,
        query,
        kv_cache_layer,
        block_tables,
        seq_lens,
        query_start_loc,
        part_acc,
        part_stats,
        scale * 1.4426950408889634,  # log2(e)
        sliding_window,
        num_seqs,
        num_heads,
        num_partitions,
        block_size,
        *query.stride(),
        *out.stride(),
        *kv_cache_layer.stride(),
        *block_tables.stride(),
        **constexprs,
        num_warps=4,
    )
    if num_partitions > 1:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_stats,
            num_heads,
            num_partitions,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=constexprs["BLOCK_D"],
            BLOCK_P=triton.next_power_of_2(num_partitions),
            num_warps=1,
        )
    return out
