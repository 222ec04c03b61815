"""A layer's sliding window through ``layers.attention.paged_attention``, the call the model makes.

The window is a per-call (per-layer) argument over the step's shared ``AttentionMetadata``: a
step mixing decodes, a chunk with a cached prefix longer than the window and a fresh prompt must
attend, token by token, to its last ``W`` positions only (a float64 loop over the cache is the
reference), on every backend the dispatcher picks on this machine and on the forced torch
reference; without a window (``None``, 0) the call is today's, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.model.layers.attention import paged_attention
from tests.helpers.model_steps import attn_batch

BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 16, 2, 3, 64


def _step(dtype: torch.dtype, seed: int = 0):
    """A cache holding earlier positions' K/V, and one step: two decodes (contexts of 40 and 7),
    a 12-token chunk after 37 cached ones, and a 25-token prompt."""
    gen = torch.Generator().manual_seed(seed)
    decodes = [([3, 9, 4], 40), ([7], 7)]
    prefills = [([1, 5, 11, 2], 37, 12), ([6, 0], 0, 25)]
    meta, positions = attn_batch(decodes, prefills, block_size=BLOCK_SIZE)
    cache = torch.randn(14, 3, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)[:, 1]
    tokens = len(positions)
    q = torch.randn(tokens, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    k, v = torch.randn(2, tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = [bt for bt, _ in decodes] + [bt for bt, _, _ in prefills]
    return q, k, v, cache, meta, positions.tolist(), tables


def _naive(q, cache, positions, tables, window: int) -> torch.Tensor:
    """Each token over its sequence's positions p - W < k <= p, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    cache = cache.double()
    token_seq = [0, 1] + [2] * 12 + [3] * 25
    for token, pos in enumerate(positions):
        table = tables[token_seq[token]]
        first = max(0, pos - window + 1) if window else 0
        ks = torch.stack([cache[table[p // BLOCK_SIZE], 0, p % BLOCK_SIZE] for p in range(first, pos + 1)])
        vs = torch.stack([cache[table[p // BLOCK_SIZE], 1, p % BLOCK_SIZE] for p in range(first, pos + 1)])
        for head in range(q.shape[1]):
            scores = ks[:, head // GROUP] @ q[token, head].double() / math.sqrt(HEAD_DIM)
            out[token, head] = torch.softmax(scores, 0) @ vs[:, head // GROUP]
    return out


@pytest.mark.parametrize("backend", ["", "torch"], ids=["dispatched", "torch-reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 16, 30, 100])
def test_each_token_attends_to_its_window(monkeypatch, backend, dtype, window):
    monkeypatch.setenv("PDSERVE_KERNELS", backend)
    q, k, v, cache, meta, positions, tables = _step(dtype)
    out = paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5, sliding_window=window)
    want = _naive(q, cache, positions, tables, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["", "torch"], ids=["dispatched", "torch-reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_window_is_todays_call(monkeypatch, backend, dtype):
    monkeypatch.setenv("PDSERVE_KERNELS", backend)
    q, k, v, cache, meta, *_ = _step(dtype, seed=1)
    today = paged_attention(q, k, v, cache.clone(), meta, HEAD_DIM**-0.5)
    for window in (None, 0):
        again = paged_attention(q, k, v, cache.clone(), meta, HEAD_DIM**-0.5, sliding_window=window)
        assert torch.equal(again, today), window
