"""The causal prefill fast path: a chunk with no cached prefix attends over its own new K/V with
``is_causal=True`` instead of gathering them back from the paged cache behind an explicit mask.

Both paths must give the same attention (to float tolerance), the fast path must be the one
taken for exactly the chunks that start at position 0, and a whole model forward must give the
same logits and greedy tokens either way.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import kernels
from pdserve.engine.model.loader import load_model
from pdserve.kernels import reference
from tests.helpers.model_steps import BLOCK_SIZE, attn_batch, run_step

# (tokens in this chunk, context length including them): q == context means no cached prefix.
CHUNKS = [(13, 13), (5, 21), (1, 1), (16, 16), (7, 30), (33, 33)]


def _batch(gen: torch.Generator, group: int, dtype: torch.dtype):
    """A paged cache holding every chunk's prefix and new K/V, plus the chunks' q/k/v."""
    num_kv_heads, head_dim, block_size = 2, 16, 4
    blocks = [math.ceil(seq_len / block_size) for _, seq_len in CHUNKS]
    cache = torch.randn(sum(blocks) + 3, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(cache.shape[0], generator=gen)
    tables = torch.zeros(len(CHUNKS), max(blocks), dtype=torch.int32)
    starts, slots, used = [0], [], 0
    for seq, ((q_len, seq_len), n) in enumerate(zip(CHUNKS, blocks, strict=True)):
        tables[seq, :n] = perm[used : used + n]
        used += n
        starts.append(starts[-1] + q_len)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[seq, pos // block_size]) * block_size + pos % block_size)
    num_tokens = starts[-1]
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    reference.reshape_and_cache_ref(key, value, cache, torch.tensor(slots, dtype=torch.int64))
    args = (
        query,
        cache,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([seq_len for _, seq_len in CHUNKS], dtype=torch.int32),
        head_dim**-0.5,
    )
    return args, key, value


@pytest.fixture
def fast_path_calls(monkeypatch) -> list[int]:
    """Records the chunk length of every call to the fast path (which still runs)."""
    calls: list[int] = []
    original = reference.causal_self_attention_ref

    def spy(query, key, value, scale):
        calls.append(query.shape[0])
        return original(query, key, value, scale)

    monkeypatch.setattr(reference, "causal_self_attention_ref", spy)
    return calls


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_fast_path_agrees_with_gathered_path(group, dtype, fast_path_calls):
    args, key, value = _batch(torch.Generator().manual_seed(group), group, dtype)
    general = reference.paged_attention_prefill_ref(*args)
    assert fast_path_calls == []
    fast = reference.paged_attention_prefill_ref(*args, key=key, value=value)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fast, general, atol=tol, rtol=tol)
    # Taken for exactly the chunks that start at position 0, in batch order.
    assert fast_path_calls == [q for q, seq_len in CHUNKS if q == seq_len]


def test_causal_fast_path_rounds_kv_to_the_cache_dtype(fast_path_calls):
    """With a bfloat16 cache and float32 activations, both paths see bfloat16 K/V."""
    args, key, value = _batch(torch.Generator().manual_seed(7), 3, torch.float32)
    query, cache, *rest = args
    cache16 = cache.to(torch.bfloat16)
    general = reference.paged_attention_prefill_ref(query, cache16, *rest)
    fast = reference.paged_attention_prefill_ref(query, cache16, *rest, key=key, value=value)
    assert fast.dtype == general.dtype == torch.float32
    torch.testing.assert_close(fast, general, atol=2e-2, rtol=2e-2)
    assert len(fast_path_calls) == 4


def test_model_prefill_takes_fast_path_and_matches_general_path(tiny_model_dir, fast_path_calls, monkeypatch):
    """A tiny-model forward with one fresh prompt and one continued chunk: the fast path serves
    the fresh one (once per layer), and the logits equal those of the gathered path."""
    tiny = load_model(tiny_model_dir)
    ids = [(i * 37) % 250 + 3 for i in range(60)]
    fresh, prefix, chunk = ids[:45], ids[:20], ids[20:50]

    def logits() -> torch.Tensor:
        kv = tiny.arch.kv_cache_spec(BLOCK_SIZE).allocate(12)
        meta, pos = attn_batch(prefills=[([6, 7], 0, len(prefix))])
        run_step(tiny.model, kv, prefix, meta, pos)
        meta, pos = attn_batch(prefills=[([0, 1, 2], 0, len(fresh)), ([6, 7, 8, 9], len(prefix), len(chunk))])
        return run_step(tiny.model, kv, fresh + chunk, meta, pos)

    fast = logits()
    num_layers = tiny.arch.num_layers
    # Two fresh prefills per run (prefix, then fresh) take it; the continued chunk never does.
    assert fast_path_calls == [len(prefix)] * num_layers + [len(fresh)] * num_layers

    general_prefill = kernels.paged_attention_prefill

    def without_new_kv(*args, key=None, value=None):
        return general_prefill(*args)

    monkeypatch.setattr(kernels, "paged_attention_prefill", without_new_kv)
    fast_path_calls.clear()
    general = logits()
    assert fast_path_calls == []
    torch.testing.assert_close(fast, general, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.argmax(-1), general.argmax(-1))
