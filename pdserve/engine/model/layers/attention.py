"""Attention over the paged KV cache, as the model's layers call it.

The runner orders each batch decodes first (one token each), then prefill/extend chunks, and
describes it with one ``AttentionMetadata`` shared by every layer of a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import kernels


@dataclass
class AttentionMetadata:
    """Where each flattened token's K/V goes, and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token (-1: padding)
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length incl. the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets from num_decode_tokens
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context length incl. the chunk


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write this step's K/V into the cache (unless ``kv_written``: the caller already did, as
    ``cpu_layer_ops.rope_and_cache`` does), then attend: decodes batched, prefills causally.

    The new K/V also go to the prefill op, so a chunk with no cached prefix can attend over them
    directly instead of reading them back from the cache (see ``causal_self_attention_ref``).

    ``sliding_window``: this layer's window ``W`` (the query at position ``p`` attends to
    positions ``p - W < k <= p``: transformers' Mistral / Gemma 3 sliding layers, llama.cpp's
    SWA), ``None`` or 0 for full attention. A per-call argument: layers of one model may differ
    (Gemma 3 interleaves sliding and global layers), while ``meta`` is shared by all of them.
    """
    if not kv_written:
        kernels.reshape_and_cache(key, value, kv_cache_layer, meta.slot_mapping)
    # Without a window, the kernels' calls are those made before windows existed.
    window = {"sliding_window": sliding_window} if sliding_window else {}
    num_decode = meta.num_decode_tokens
    if num_decode == query.shape[0]:
        return kernels.paged_attention_decode(
            query, kv_cache_layer, meta.decode_block_tables, meta.decode_seq_lens, scale, **window
        )
    if num_decode == 0:
        return kernels.paged_attention_prefill(
            query,
            kv_cache_layer,
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_seq_lens,
            scale,
            key=key,
            value=value,
            **window,
        )
    out = torch.empty_like(query)
    out[:num_decode] = kernels.paged_attention_decode(
        query[:num_decode], kv_cache_layer, meta.decode_block_tables, meta.decode_seq_lens, scale, **window
    )
    out[num_decode:] = kernels.paged_attention_prefill(
        query[num_decode:],
        kv_cache_layer,
        meta.prefill_block_tables,
        meta.prefill_query_start_loc,
        meta.prefill_seq_lens,
        scale,
        key=key[num_decode:],
        value=value[num_decode:],
        **window,
    )
    return out
