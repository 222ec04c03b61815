"""Torch reference implementations of the paged-KV-cache kernels.

These are what the CPU engine path runs, and what the Triton kernels are tested against.

KV cache layout (one tensor per engine, see ``pdserve.engine.kv_layout``)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

One block of *all* layers is contiguous, so a KV transfer moves one descriptor per block
instead of one per (layer, block). A layer's view ``kv_cache[:, layer]`` has shape
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; index 0 of dim 1 is K, 1 is V.
A *slot* is ``block_id * block_size + offset``; a negative slot means "padding, don't write".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's K and V into the cache slot ``slot_mapping[i]`` (skipping slots < 0)."""
    block_size = kv_cache_layer.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_idx = torch.div(slot_mapping, block_size, rounding_mode="floor")
    block_off = slot_mapping % block_size
    kv_cache_layer[block_idx, 0, block_off] = key.to(kv_cache_layer.dtype)
    kv_cache_layer[block_idx, 1, block_off] = value.to(kv_cache_layer.dtype)


def _gather_context(
    kv_cache_layer: torch.Tensor, block_table: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``num_blocks`` blocks: [num_blocks*block_size, H, D] each."""
    idx = block_table[:num_blocks].long()
    # Index the K (then V) view directly: one gather each, already contiguous, no re-copy.
    keys = kv_cache_layer[:, 0][idx].flatten(0, 1)
    values = kv_cache_layer[:, 1][idx].flatten(0, 1)
    return keys, values


def paged_attention_decode_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query token per sequence
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the query token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Single-token attention over each sequence's paged context (GQA by head grouping).

    Batched: all sequences' blocks are gathered up to the longest one and the tail is masked,
    which on CPU is far cheaper than one small attention call per sequence.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    max_len = int(seq_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    idx = block_tables[:, :max_blocks].long()
    # One gather per K and V straight from the layer view: contiguous, reshaped for free.
    keys = kv_cache_layer[:, 0][idx].view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    values = kv_cache_layer[:, 1][idx].view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    positions = torch.arange(max_blocks * block_size, device=query.device)
    mask = positions[None, :] < seq_lens[:, None].to(positions.dtype)  # [S, L]
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, num_kv_heads, group, head_dim).to(keys.dtype)
    k = keys.transpose(1, 2)  # [S, Hkv, L, D]
    v = values.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [S, Hkv, group, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def causal_self_attention_ref(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]: one chunk starting at position 0
    key: torch.Tensor,  # [q_len, num_kv_heads, head_dim]: that chunk's own K
    value: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] (a strided view)
    """Causal attention of a chunk with no cached prefix, over its own K/V.

    Such a chunk attends to nothing but itself, so its contiguous new K/V are the whole context:
    no gather from the paged cache is needed, and ``is_causal=True`` replaces the explicit mask.
    That matters on CPU: with a mask, SDPA runs its math path (the full [heads, q, L] score
    matrix, ~4x slower at 512 tokens); with ``is_causal`` and no mask it runs the flash kernel,
    which also skips the upper triangle. ``enable_gqa`` lets query heads share KV heads without a
    repeated copy; it is the call transformers makes for an unpadded prompt, so both round alike.
    """
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
        key.transpose(0, 1).unsqueeze(0),  # [1, Hkv, q, D]
        value.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def paged_attention_prefill_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query chunks, concatenated
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: chunk boundaries in `query`
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the chunk
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the chunks' new K
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: the chunks' new V
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each query chunk over its cached prefix and itself.

    Query token ``i`` of a chunk of length ``q`` sits at position ``seq_len - q + i`` and attends
    to positions ``<= seq_len - q + i``. The chunk's own K/V must already be in the cache.

    When ``key``/``value`` (the step's new K/V, laid out like ``query``) are given, a chunk that
    starts at position 0 (no cached prefix) takes ``causal_self_attention_ref`` on them instead:
    same result, no gather and no explicit mask.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    group = num_heads // num_kv_heads
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
            out[q_start:q_end] = causal_self_attention_ref(
                query[q_start:q_end].to(kv_cache_layer.dtype),
                key[q_start:q_end].to(kv_cache_layer.dtype),
                value[q_start:q_end].to(kv_cache_layer.dtype),
                scale,
            ).to(query.dtype)
            continue
        keys, values = _gather_context(
            kv_cache_layer, block_tables[seq], (seq_len + block_size - 1) // block_size
        )
        keys, values = keys[:seq_len], values[:seq_len]  # [L, Hkv, D]
        # Fold the query heads sharing a KV head into the query-length axis: one attention per
        # KV head with no broadcast or copy of K/V (both make CPU SDPA take its slow path).
        q = query[q_start:q_end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * q_len, head_dim)
        k = keys.permute(1, 0, 2)  # [Hkv, L, D]
        v = values.permute(1, 0, 2)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None]).repeat(group, 1)  # [group * q, L]
        attn = F.scaled_dot_product_attention(q.to(keys.dtype), k, v, attn_mask=mask, scale=scale)
        attn = attn.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_start:q_end] = attn.reshape(q_len, num_heads, head_dim).to(query.dtype)
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
