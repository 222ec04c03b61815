"""The torch references themselves, checked against naive per-token float64 loops.

The Triton kernels are tested against the references, so the references must be right: here
each one is compared with the most literal implementation possible (one query token, one head,
one context position at a time, in float64). Sizes are awkward on purpose: context lengths that
are not multiples of the block size, 1-token contexts, GQA ratios 1, 3 and 8. Sliding windows
(the query at ``p`` sees ``p - W < k <= p``, transformers' mask) smaller than, equal to and
larger than the contexts, starting mid-block and on a block boundary.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import reference

BLOCK_SIZE = 4


def _paged_cache(
    gen: torch.Generator, seq_lens: list[int], num_kv_heads: int, head_dim: int, num_layers: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random float64 cache with each sequence's blocks scattered, and its block tables."""
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.randn(num_blocks, num_layers, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    cache = cache.double()
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = perm[used : used + n]
        used += n
    return cache, tables


def _naive_attention(
    q: torch.Tensor,  # [head_dim] one head of one token
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    kv_head: int,
    num_visible: int,  # positions 0 .. num_visible - 1 are attended to
    scale: float,
    window: int = 0,  # > 0: only the last `window` of them
) -> torch.Tensor:
    """Softmax attention over the visible positions, one position at a time."""
    scores, values = [], []
    for pos in range(max(0, num_visible - window) if window else 0, num_visible):
        block, offset = int(table[pos // BLOCK_SIZE]), pos % BLOCK_SIZE
        scores.append(float(q @ kv_layer[block, 0, offset, kv_head]) * scale)
        values.append(kv_layer[block, 1, offset, kv_head])
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return sum(w / total * v for w, v in zip(weights, values, strict=True))


@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_reference_decode_matches_naive_float64(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    num_kv_heads, head_dim, seq_lens = 2, 8, [1, 4, 5, 11]
    cache, tables = _paged_cache(gen, seq_lens, num_kv_heads, head_dim)
    layer = cache[:, 1]
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).double()
    scale = head_dim**-0.5
    out = reference.paged_attention_decode_ref(
        query, layer, tables, torch.tensor(seq_lens, dtype=torch.int32), scale
    )
    for seq, seq_len in enumerate(seq_lens):
        for head in range(num_kv_heads * group):
            expected = _naive_attention(query[seq, head], layer, tables[seq], head // group, seq_len, scale)
            torch.testing.assert_close(out[seq, head], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_reference_prefill_matches_naive_float64(group: int) -> None:
    gen = torch.Generator().manual_seed(10 + group)
    num_kv_heads, head_dim = 2, 8
    chunks = [(1, 1), (3, 7), (6, 6), (1, 9), (0, 5)]  # (query tokens, context length incl. them)
    seq_lens = [n for _, n in chunks]
    cache, tables = _paged_cache(gen, seq_lens, num_kv_heads, head_dim)
    layer = cache[:, 0]
    starts = [0]
    for q_len, _ in chunks:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).double()
    scale = head_dim**-0.5
    out = reference.paged_attention_prefill_ref(
        query,
        layer,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
    )
    for seq, (q_len, seq_len) in enumerate(chunks):
        for i in range(q_len):
            token = starts[seq] + i
            position = seq_len - q_len + i
            for head in range(num_kv_heads * group):
                expected = _naive_attention(
                    query[token, head], layer, tables[seq], head // group, position + 1, scale
                )
                torch.testing.assert_close(out[token, head], expected, rtol=1e-12, atol=1e-12)


def test_kernel_reference_reshape_and_cache_writes_only_mapped_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(5, 2, 2, BLOCK_SIZE, 3, 8, generator=gen)
    before = cache.clone()
    key = torch.randn(4, 3, 8, generator=gen)
    value = torch.randn(4, 3, 8, generator=gen)
    slots = torch.tensor([9, -1, 0, 19])
    reference.reshape_and_cache_ref(key, value, cache[:, 1], slots)
    expected = before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // BLOCK_SIZE, 1, 0, slot % BLOCK_SIZE] = key[token]
            expected[slot // BLOCK_SIZE, 1, 1, slot % BLOCK_SIZE] = value[token]
    assert torch.equal(cache, expected)


def test_kernel_reference_gather_then_scatter_moves_whole_blocks() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 3, 2, BLOCK_SIZE, 2, 8, generator=gen)
    ids = torch.tensor([4, 0, 2])
    packed = reference.gather_blocks_ref(cache, ids)
    assert packed.is_contiguous()
    for i, block in enumerate(ids.tolist()):
        assert torch.equal(packed[i], cache[block])
    other = torch.zeros_like(cache)
    reference.scatter_blocks_ref(other, torch.tensor([1, 5, 3]), packed)
    for block, src in zip([1, 5, 3], ids.tolist(), strict=True):
        assert torch.equal(other[block], cache[src])
    assert not other[[0, 2, 4]].any()


# Windows against the contexts below: 1, mid-block (3, 6), a block (4, 8), the longest context
# (30), beyond every context (64); BLOCK_SIZE 4, so window starts fall mid-block and on its edges.
WINDOWS = [1, 3, 4, 6, 8, 30, 64]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [1, 3])
def test_kernel_reference_decode_with_a_window_matches_naive_float64(group: int, window: int) -> None:
    """A batch mixing contexts of 1 to 30 tokens: each query sees its last ``window`` positions."""
    gen = torch.Generator().manual_seed(100 + group)
    num_kv_heads, head_dim, seq_lens = 2, 8, [1, 4, 5, 11, 17, 30, 9]
    cache, tables = _paged_cache(gen, seq_lens, num_kv_heads, head_dim)
    layer = cache[:, 1]
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).double()
    scale = head_dim**-0.5
    out = reference.paged_attention_decode_ref(
        query, layer, tables, torch.tensor(seq_lens, dtype=torch.int32), scale, sliding_window=window
    )
    for seq, seq_len in enumerate(seq_lens):
        for head in range(num_kv_heads * group):
            expected = _naive_attention(
                query[seq, head], layer, tables[seq], head // group, seq_len, scale, window=window
            )
            torch.testing.assert_close(out[seq, head], expected, rtol=1e-12, atol=1e-12)


# (query tokens, context length incl. them): cached prefixes longer than the windows (chunked
# prefill), chunks without a prefix (the fast path when K/V are given), one shorter than a window.
WINDOW_CHUNKS = [(3, 20), (9, 9), (1, 30), (0, 5), (2, 2), (6, 13), (40, 40)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("new_kv", [False, True], ids=["gathered", "fast-path"])
def test_kernel_reference_prefill_with_a_window_matches_naive_float64(
    window: int, new_kv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the gathered path and, with the chunks' new K/V, the no-prefix fast path; its query
    rows past the window split into several SDPA calls (16-row tiles here) as a long prompt's are."""
    monkeypatch.setattr(reference, "WINDOW_QUERY_TILE", 16)
    gen = torch.Generator().manual_seed(200 + window)
    group, num_kv_heads, head_dim = 3, 2, 8
    seq_lens = [n for _, n in WINDOW_CHUNKS]
    cache, tables = _paged_cache(gen, seq_lens, num_kv_heads, head_dim)
    layer = cache[:, 0]
    starts = [0]
    for q_len, _ in WINDOW_CHUNKS:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).double()
    key = value = None
    if new_kv:  # each chunk's own K/V, as the cache holds them
        key, value = (
            torch.empty(starts[-1], num_kv_heads, head_dim).double(),
            torch.empty(starts[-1], num_kv_heads, head_dim).double(),
        )
        for seq, (q_len, seq_len) in enumerate(WINDOW_CHUNKS):
            for i in range(q_len):
                pos = seq_len - q_len + i
                block, offset = int(tables[seq, pos // BLOCK_SIZE]), pos % BLOCK_SIZE
                key[starts[seq] + i], value[starts[seq] + i] = (
                    layer[block, 0, offset],
                    layer[block, 1, offset],
                )
    scale = head_dim**-0.5
    out = reference.paged_attention_prefill_ref(
        query,
        layer,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        key=key,
        value=value,
        sliding_window=window,
    )
    for seq, (q_len, seq_len) in enumerate(WINDOW_CHUNKS):
        for i in range(q_len):
            token, position = starts[seq] + i, seq_len - q_len + i
            for head in range(num_kv_heads * group):
                expected = _naive_attention(
                    query[token, head], layer, tables[seq], head // group, position + 1, scale, window=window
                )
                torch.testing.assert_close(out[token, head], expected, rtol=1e-12, atol=1e-12)


def test_kernel_reference_no_window_and_a_window_holding_every_context_change_no_bit() -> None:
    """``None`` and 0 are today's call; a window at least as long as every context gives the
    same bits as none (decode: the same plan; prefill: the same gather and mask; fast path: no
    window at all)."""
    gen = torch.Generator().manual_seed(7)
    num_kv_heads, head_dim = 2, 16
    seq_lens = [1, 4, 5, 11, 17, 30, 9]
    cache, tables = _paged_cache(gen, seq_lens, num_kv_heads, head_dim)
    layer = cache[:, 1].float()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), 6, head_dim, generator=gen)
    today = reference.paged_attention_decode_ref(query, layer, tables, lens, 0.25)
    for window in (None, 0, 30, 1000):
        again = reference.paged_attention_decode_ref(query, layer, tables, lens, 0.25, sliding_window=window)
        assert torch.equal(again, today), window
    chunks = [(3, 20), (9, 9), (1, 30), (6, 13)]
    starts = torch.tensor([0, 3, 12, 13, 19], dtype=torch.int32)
    cache, tables = _paged_cache(gen, [n for _, n in chunks], num_kv_heads, head_dim)
    layer = cache[:, 0].float()
    query = torch.randn(19, 6, head_dim, generator=gen)
    new_k, new_v = torch.randn(2, 19, num_kv_heads, head_dim, generator=gen)
    prefill_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    args = (query, layer, tables, starts, prefill_lens, 0.25)
    today = reference.paged_attention_prefill_ref(*args, key=new_k, value=new_v)
    for window in (None, 0, 30, 1000):
        again = reference.paged_attention_prefill_ref(*args, key=new_k, value=new_v, sliding_window=window)
        assert torch.equal(again, today), window


def test_kernel_reference_window_is_transformers_sliding_window_mask() -> None:
    """The positions a query sees are those transformers' sliding-window causal mask keeps
    (``masking_utils.sliding_window_causal_mask_function``: Mistral's and Gemma 3's)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    t = torch.tensor
    for window in (1, 2, 3, 4, 7):
        keeps = masking_utils.sliding_window_causal_mask_function(window)
        for q in range(12):
            theirs = [k for k in range(12) if bool(keeps(t(0), t(0), t(q), t(k)))]
            assert theirs == list(range(reference.window_start(q, window), q + 1)), (window, q)


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_kernel_reference_refuses_a_window_that_is_not_a_count(bad) -> None:
    assert reference.window_size(None) == reference.window_size(0) == 0
    with pytest.raises(ValueError, match="sliding_window"):
        reference.window_size(bad)


def test_kernel_reference_decode_plans_each_window_once_per_batch() -> None:
    """Layers alternating windows (Gemma 3's sliding and global layers) reuse one plan each."""
    tables = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 3, 20], dtype=torch.int32)
    full, windowed = (
        reference._decode_plan(tables, seq_lens, 16),
        reference._decode_plan(tables, seq_lens, 16, 8),
    )
    assert windowed is not full
    assert reference._decode_plan(tables, seq_lens, 16) is full
    assert reference._decode_plan(tables, seq_lens, 16, 8) is windowed
    assert sum(group.block_ids.numel() for group in windowed) < sum(group.block_ids.numel() for group in full)
