"""Torch reference implementations of the paged-KV-cache kernels.

These are what the CPU engine path runs, and what the Triton kernels are tested against.

KV cache layout (one tensor per engine, see the engine's ``kv_layout.py``)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

One block of *all* layers is contiguous, so a KV transfer moves one descriptor per block
instead of one per (layer, block). A layer's view ``kv_cache[:, layer]`` has shape
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; index 0 of dim 1 is K, 1 is V.
A *slot* is ``block_id * block_size + offset``; a negative slot means "padding, don't write".

**Sliding window.** Every attention op takes ``sliding_window`` (``W``; ``None`` or 0: full causal
attention): the query at position ``p`` then attends to the keys at positions ``k`` with
``p - W < k <= p``, the ``W`` most recent ones, itself included. That is transformers' mask
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, and'ed with the
causal mask; Mistral's and Gemma 3's sliding layers) and llama.cpp's standard SWA (a key is
masked when ``p1 - p0 >= n_swa``): the same positions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.kernels.scratch import scratch


def window_size(sliding_window: int | None) -> int:
    """``sliding_window`` as the kernels take it: the window ``W`` >= 1, or 0 for full attention
    (``None`` or 0). Anything else (a negative or non-integer value) is a caller's error."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be None or an int >= 0, not {sliding_window!r}")
    return sliding_window


def window_start(position: int, window: int) -> int:
    """The first position the query at ``position`` attends to (``window``: ``window_size``'s)."""
    return max(0, position - window + 1) if window else 0


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K and V into the cache slot ``slot_mapping[i]`` (skipping slots < 0)."""
    slots = _slot_indices(slot_mapping, kv_cache_layer.shape[2])
    if slots.valid is not None:
        key, value = key[slots.valid], value[slots.valid]
    kv_cache_layer[slots.block_idx, 0, slots.block_off] = key.to(kv_cache_layer.dtype)
    kv_cache_layer[slots.block_idx, 1, slots.block_off] = value.to(kv_cache_layer.dtype)


@dataclass
class _SlotIndices:
    """Where a slot mapping's tokens go: the same for every layer of a forward pass."""

    slot_mapping: torch.Tensor  # the mapping these were computed from (held: see _slot_indices)
    block_size: int
    valid: torch.Tensor | None  # [num_tokens] bool, None when no slot is padding
    block_idx: torch.Tensor  # [num_valid] int64
    block_off: torch.Tensor  # [num_valid] int64


_last_slots = threading.local()  # .entry: a _SlotIndices


def _slot_indices(slot_mapping: torch.Tensor, block_size: int) -> _SlotIndices:
    """Block ids and offsets of a slot mapping, computed once per forward pass, not per layer.

    Every layer of a pass gets the same ``slot_mapping`` tensor, so the last result is reused
    while the mapping is that very object (the entry holds it, so its id cannot be recycled;
    the runner builds a new mapping for every pass and never writes one in place). Saves four
    small ops and a sync per layer: ~1.7 ms of a 35 ms one-token decode step of SmolLM2.
    """
    last: _SlotIndices | None = getattr(_last_slots, "entry", None)
    if last is not None and last.slot_mapping is slot_mapping and last.block_size == block_size:
        return last
    valid_mask = slot_mapping >= 0
    valid = None if bool(valid_mask.all()) else valid_mask
    slots = slot_mapping if valid is None else slot_mapping[valid]
    entry = _SlotIndices(
        slot_mapping,
        block_size,
        valid,
        torch.div(slots, block_size, rounding_mode="floor"),
        slots % block_size,
    )
    _last_slots.entry = entry
    return entry


def _gather_context(
    kv_cache_layer: torch.Tensor, block_table: torch.Tensor, num_blocks: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's blocks ``first_block .. num_blocks - 1``:
    [(num_blocks - first_block) * block_size, H, D] each."""
    idx = block_table[first_block:num_blocks].long()
    # Index the K (then V) view directly: one gather each, already contiguous, no re-copy.
    keys = _gather_into("prefill_k", kv_cache_layer[:, 0], idx).flatten(0, 1)
    values = _gather_into("prefill_v", kv_cache_layer[:, 1], idx).flatten(0, 1)
    return keys, values


def _gather_into(name: str, blocks: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``blocks[idx]`` (idx 1-D) written into the scratch buffer ``name``: valid until the next
    gather into the same buffer, so callers use it before returning."""
    out = scratch(name, (idx.numel(), *blocks.shape[1:]), blocks.dtype, blocks.device)
    return torch.index_select(blocks, 0, idx, out=out)


# A decode group may gather up to PADDING x its members' real context + SLACK positions (see
# below); the slack, about what one more attention call costs, keeps short contexts together.
DECODE_GROUP_PADDING = 1.25
DECODE_GROUP_SLACK = 512


def decode_length_groups(seq_lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar context length, shortest first.

    Walking the lengths in ascending order, a sequence joins the current group unless that
    would pad the group (``size x longest``) beyond ``DECODE_GROUP_PADDING`` times its real
    total plus ``DECODE_GROUP_SLACK``. With a long-tailed mix (chat traffic), padding every
    sequence to the longest one made the gather, which dominates CPU decode attention, several
    times larger than the contexts themselves (4x at 200 ShareGPT-like requests, 1.24x in 6
    groups); a few groups cost a few more calls.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for index in order:
        length = seq_lens[index]
        padded_limit = DECODE_GROUP_PADDING * (total + length) + DECODE_GROUP_SLACK
        if groups and (len(groups[-1]) + 1) * length <= padded_limit:
            groups[-1].append(index)
            total += length
        else:
            groups.append([index])
            total = length
    return groups


def paged_attention_decode_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the query token
    scale: float,
    *,
    sliding_window: int | None = None,  # W: the query at p sees p - W < k <= p (module docstring)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Single-token attention over each sequence's paged context (GQA by head grouping).

    Batched by groups of similar length (``decode_length_groups``): each group's blocks are
    gathered up to its longest member and the tail is masked, which on CPU is far cheaper than
    one small attention call per sequence, and wastes little on padding. With a sliding window a
    sequence's gather starts at the block holding its window's first position (the positions
    before it in that block are masked): a long context costs its window, not its length.
    """
    block_size = kv_cache_layer.shape[2]
    groups = _decode_plan(block_tables, seq_lens, block_size, window_size(sliding_window))
    if groups[0].rows is None:
        return _decode_attention(query, kv_cache_layer, groups[0], scale)
    out = torch.empty_like(query)
    for group in groups:
        out[group.rows] = _decode_attention(query[group.rows], kv_cache_layer, group, scale)
    return out


@dataclass
class _DecodeGroup:
    """What one group's attention needs besides the query: the same for every layer."""

    rows: torch.Tensor | None  # [n] int64: the group's sequences (None: the whole batch)
    block_ids: torch.Tensor  # [n * max_blocks] int64: their blocks, padded to the longest
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: the positions each one attends to


@dataclass
class _CachedPlan:
    """The last plan built on this thread, with copies of the inputs it was built from."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    window: int
    groups: list[_DecodeGroup]

    def matches(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int
    ) -> bool:
        return (
            self.block_size == block_size
            and self.window == window
            and self.block_tables.shape == block_tables.shape
            and self.seq_lens.shape == seq_lens.shape
            and self.block_tables.device == block_tables.device
            and torch.equal(self.block_tables, block_tables)
            and torch.equal(self.seq_lens, seq_lens)
        )


_last_plan = threading.local()  # .entries: {window: the last _CachedPlan built for it}


def _decode_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int = 0
) -> list[_DecodeGroup]:
    """The groups of a decode batch, built once per forward pass rather than once per layer.

    Every layer of a pass gets the same batch, so the last plan is reused while the block
    tables and lengths equal (by value) copies of the ones it was built from: a few thousand
    ints to compare. Not identity or version counters: the runner builds its metadata under
    ``inference_mode``, whose tensors have no version counter, and a buffer rewritten in place
    keeps its identity. One plan is kept per window, so that a model whose layers alternate
    windows (Gemma 3: five sliding layers, then a global one) plans each kind once a pass.

    ``window`` (``window_size``'s): each sequence's gather starts at the block of its window's
    first position, and sequences are grouped by what they gather from there. Where every
    window covers its whole context, the plan is the full-attention one, tensor for tensor.
    """
    entries: dict[int, _CachedPlan] = getattr(_last_plan, "entries", None) or {}
    last = entries.get(window)
    if last is not None and last.matches(block_tables, seq_lens, block_size, window):
        return last.groups
    lens = seq_lens.tolist()
    # Each sequence's first gathered block, and the positions it gathers from that block's start.
    firsts = [window_start(n - 1, window) // block_size for n in lens]
    spans = [n - first * block_size for n, first in zip(lens, firsts, strict=True)]
    groups = decode_length_groups(spans)
    device = seq_lens.device
    plan = []
    for members in groups:
        rows = None if len(groups) == 1 else torch.tensor(members, device=device)
        tables = block_tables if rows is None else block_tables[rows]
        group_lens = seq_lens if rows is None else seq_lens[rows]
        max_blocks = -(-max(spans[i] for i in members) // block_size)
        positions = torch.arange(max_blocks * block_size, device=device)
        if not window:
            mask = positions[None, :] < group_lens[:, None].to(positions.dtype)
            block_ids = tables[:, :max_blocks].reshape(-1).long()
        else:
            order = members if rows is not None else range(len(lens))  # the group's rows, in order
            first = torch.tensor([firsts[i] for i in order], device=device)
            # Columns past a table's end only pad a shorter member (masked): any block will do.
            cols = (first[:, None] + torch.arange(max_blocks, device=device)).clamp_(max=tables.shape[1] - 1)
            block_ids = tables.gather(1, cols).reshape(-1).long()
            absolute = first[:, None] * block_size + positions[None, :]
            ends = group_lens[:, None].to(positions.dtype)
            mask = (absolute < ends) & (absolute >= ends - window)
        plan.append(_DecodeGroup(rows, block_ids, mask[:, None, None, :]))
    entries.pop(window, None)  # the newest last
    if len(entries) >= 4:  # a model has a window or two: a bound, not a policy
        del entries[next(iter(entries))]
    entries[window] = _CachedPlan(block_tables.clone(), seq_lens.clone(), block_size, window, plan)
    _last_plan.entries = entries
    return plan


def _decode_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    kv_cache_layer: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """One group's attention: every context padded to the group's longest, the tail masked."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache_layer.shape[3]
    context = group.mask.shape[-1]
    # One gather per K and V straight from the layer view into a reused buffer (see
    # ``scratch``): contiguous, reshaped for free.
    keys = _gather_into("decode_k", kv_cache_layer[:, 0], group.block_ids)
    values = _gather_into("decode_v", kv_cache_layer[:, 1], group.block_ids)
    k = keys.view(num_seqs, context, num_kv_heads, head_dim).transpose(1, 2)  # [S, Hkv, L, D]
    v = values.view(num_seqs, context, num_kv_heads, head_dim).transpose(1, 2)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(keys.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)  # [S, Hkv, g, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


class ChunkAttention(Protocol):
    """How a chunk attends: ``(query, key, value, scale)``, the queries at the last of the keys'
    positions (a chunk with no cached prefix: its own K/V alone), -> output, or None where it does
    not run (``paged_attention_prefill_ref`` then takes SDPA). Called with ``sliding_window=W``
    only where a window applies (for a chunk with no prefix: where ``W`` < its length), with
    positions counted from the first key given."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor | None: ...


# Query rows per SDPA call of a windowed chunk past its first W rows (causal_self_attention_ref).
WINDOW_QUERY_TILE = 128


def causal_self_attention_ref(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]: one chunk starting at position 0
    key: torch.Tensor,  # [q_len, num_kv_heads, head_dim]: that chunk's own K
    value: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
    scale: float,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] (a strided view)
    """Causal attention of a chunk with no cached prefix, over its own K/V.

    With a ``sliding_window`` ``W`` shorter than the chunk, its first ``W`` rows see every key
    up to their own (the ``is_causal`` call below, over those rows), and the rest take SDPA with
    an explicit mask (as transformers' sliding layers do: ``is_causal`` cannot say "window") in
    tiles of ``WINDOW_QUERY_TILE`` rows, each over the keys its rows see, so a long prompt costs
    ``O(q_len * W)`` rather than ``O(q_len^2)``: 4096 tokens, ``W`` 512, SmolLM2's heads, one
    core, 245 ms for full causal attention, 78-95 ms in tiles of 64-256 rows, 123 in tiles of
    512, 185 of 1024. A window the chunk fits in is no window (the ``is_causal`` call, bit for
    bit).

    Such a chunk attends to nothing but itself, so its contiguous new K/V are the whole context:
    no gather from the paged cache is needed, and ``is_causal=True`` replaces the explicit mask,
    which lets CPU SDPA's flash kernel skip the blocks above the diagonal instead of computing
    and masking them. ``enable_gqa`` lets query heads share KV heads without a repeated copy. It
    is the call transformers makes for an unpadded prompt, so both round alike. (Before this
    path and the general path's ``enable_gqa``, prefill attention ran SDPA's math path on a
    repeated mask and took ~25% of a 512-token prefill of SmolLM2-135M.)
    """
    window, q_len = window_size(sliding_window), query.shape[0]
    if window and window < q_len:
        return _windowed_self_attention(query, key, value, scale, window)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
        key.transpose(0, 1).unsqueeze(0),  # [1, Hkv, q, D]
        value.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _windowed_self_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """``causal_self_attention_ref`` with a window shorter than the chunk: its first ``W`` rows
    causally, then query rows ``[q0, q1)`` over keys ``[q0 - W + 1, q1)`` with the window's
    mask, a call a tile."""
    q_len = query.shape[0]
    out = query.new_empty(query.shape)
    out[:window] = causal_self_attention_ref(query[:window], key[:window], value[:window], scale)
    q_all, k_all, v_all = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, H, L, D]
    for q0 in range(window, q_len, WINDOW_QUERY_TILE):
        q1, k0 = min(q_len, q0 + WINDOW_QUERY_TILE), window_start(q0, window)
        distance = torch.arange(q0, q1, device=query.device)[:, None] - torch.arange(
            k0, q1, device=query.device
        )
        mask = (distance >= 0) & (distance < window)  # [q1 - q0, q1 - k0]
        attn = F.scaled_dot_product_attention(
            q_all[:, :, q0:q1],
            k_all[:, :, k0:q1],
            v_all[:, :, k0:q1],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q0:q1] = attn[0].transpose(0, 1)
    return out


def _attend(
    attention: ChunkAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor | None:
    """``attention`` called with ``sliding_window`` only for a window (> 0), as the hooks' contract says."""
    if window:
        return attention(query, key, value, scale, sliding_window=window)
    return attention(query, key, value, scale)


def paged_attention_prefill_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query chunks, concatenated
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: chunk boundaries in `query`
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the chunk
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the chunks' new K
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the chunks' new V
    self_attention: ChunkAttention | None = None,
    prefix_attention: ChunkAttention | None = None,
    *,
    sliding_window: int | None = None,  # W: the query at p sees p - W < k <= p (module docstring)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each query chunk over its cached prefix and itself.

    Query token ``i`` of a chunk of length ``q`` sits at position ``p = seq_len - q + i`` and
    attends to positions ``<= p`` (and ``> p - W`` with a ``sliding_window`` ``W``: then only the
    blocks from the one holding the chunk's first query's first key on are gathered). The
    chunk's own K/V must already be in the cache.

    When ``key``/``value`` (the step's new K/V, laid out like ``query``) are given, a chunk that
    starts at position 0 (no cached prefix) takes ``causal_self_attention_ref`` on them instead:
    same result, no gather and no explicit mask. ``self_attention`` replaces that function (the
    CPU engine's C kernel where it runs: ``kernels.paged_attention_prefill``). A chunk after a
    cached prefix goes to ``prefix_attention`` (the same C kernel) if given, over the gathered K/V.
    """
    window = window_size(sliding_window)
    block_size = kv_cache_layer.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for seq, seq_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if key is not None and value is not None and q_len == seq_len:
            # Round K/V to the cache dtype as the gathered path would see them.
            chunk = (
                query[q_start:q_end].to(kv_cache_layer.dtype),
                key[q_start:q_end].to(kv_cache_layer.dtype),
                value[q_start:q_end].to(kv_cache_layer.dtype),
            )
            cut = window if window < q_len else 0  # a window that holds the whole chunk is no window
            attended = _attend(self_attention, *chunk, scale, cut) if self_attention is not None else None
            if attended is None:  # no hook, or it does not run here: SDPA
                ref = causal_self_attention_ref
                attended = ref(*chunk, scale, sliding_window=cut) if cut else ref(*chunk, scale)
            out[q_start:q_end] = attended.to(query.dtype)
            continue
        # From the block holding the first key the chunk's first query sees (0: no window).
        first_block = window_start(seq_len - q_len, window) // block_size
        first_pos = first_block * block_size
        keys, values = _gather_context(
            kv_cache_layer, block_tables[seq], (seq_len + block_size - 1) // block_size, first_block
        )
        keys, values = keys[: seq_len - first_pos], values[: seq_len - first_pos]  # [L, Hkv, D]
        if prefix_attention is not None:
            chunk_query = query[q_start:q_end].to(keys.dtype)
            over_prefix = _attend(prefix_attention, chunk_query, keys, values, scale, window)
            if over_prefix is not None:
                out[q_start:q_end] = over_prefix.to(query.dtype)
                continue
        # One call over all heads: enable_gqa shares each KV head with its query heads (no
        # repeated K/V) and the [q, L] mask is shared by every head. On torch 2.13's CPU SDPA
        # this runs 2-3x faster than folding the query heads into the length axis with a
        # repeated mask (measured at q 64-1000, L 500-1024, SmolLM2's 9/3 heads).
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        k = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = values.transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(first_pos, seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q, L]
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        attn = F.scaled_dot_product_attention(
            q.to(keys.dtype), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[q_start:q_end] = attn[0].transpose(0, 1).to(query.dtype)
    return out


def gather_blocks_ref(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    out: torch.Tensor | None = None,  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:
    """Pack the listed blocks (all layers) into one contiguous buffer, in ``block_ids`` order."""
    if out is None:
        return kv_cache.index_select(0, block_ids.long())
    torch.index_select(kv_cache, 0, block_ids.long(), out=out)
    return out


def scatter_blocks_ref(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    src: torch.Tensor,  # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
) -> None:
    """Unpack a contiguous buffer produced by ``gather_blocks`` into the listed block ids."""
    kv_cache.index_copy_(0, block_ids.long(), src.to(kv_cache.dtype))
