"""The bf16 prefill attention of a chunk with no cached prefix (``kernels/cpu/csrc/causal_attention.c``).

It must give what SDPA gives (``reference.causal_self_attention_ref``) to a rounding of the bf16
output, and its error against an fp32 computation must be no larger than SDPA's own: for every
length (partial tiles of 16 keys and odd key pairs), GQA group and head_dim it takes, on query,
key and value rows that lie apart in one projection output as the engine's do. Where it does
not run (fp32, other head sizes, CPUs without AVX512-BF16) the prefill keeps SDPA.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import causal_attention as cpu_causal_attention

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")
runs_here = pytest.mark.skipif(not cpu_causal_attention._runs_here(64), reason="the kernel needs AVX512-BF16")


def projection(length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """``(q, k, v)``: bf16 views of one ``[length, heads + 2 kv_heads, head_dim]`` tensor, as the
    engine splits its fused qkv projection (rows lie ``heads + 2 kv_heads`` heads apart)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(length, heads + 2 * kv_heads, head_dim, generator=gen)).to(torch.bfloat16)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


@runs_here
@pytest.mark.parametrize("length", [1, 2, 3, 15, 16, 17, 64, 100, 301])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_it_gives_what_sdpa_gives(length, heads, head_dim):
    q, k, v = projection(length, *heads, head_dim, seed=length)
    scale = head_dim**-0.5
    assert cpu_causal_attention.serves(q, k, v)
    got = cpu_causal_attention.causal_attention(q, k, v, scale)
    want = reference.causal_self_attention_ref(q, k, v, scale)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # A few bf16 steps of the output apart at most: both round P to bf16, in other orders.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5)
    exact = reference.causal_self_attention_ref(q.float(), k.float(), v.float(), scale)
    ours, sdpas = (got.float() - exact).abs().max(), (want.float() - exact).abs().max()
    assert ours <= sdpas * 1.5 + 1e-3, (ours, sdpas)


@runs_here
def test_a_row_attends_to_its_own_position_and_before_only():
    q, k, v = projection(40, 4, 2, 64, seed=3)
    full = cpu_causal_attention.causal_attention(q, k, v, 0.125)
    changed = v.clone()
    changed[30:] = 100.0  # later positions' values: rows up to 29 must not see them
    again = cpu_causal_attention.causal_attention(q, k, changed, 0.125)
    assert torch.equal(full[:30], again[:30])
    assert not torch.equal(full[30:], again[30:])
    assert torch.equal(full[0], v[0].repeat_interleave(2, dim=0))  # one key: its value, exactly


def test_what_it_does_not_take_stays_with_sdpa():
    q, k, v = projection(8, 4, 2, 64)
    assert not cpu_causal_attention.serves(q.float(), k.float(), v.float())
    q48, k48, v48 = projection(8, 4, 2, 48)
    assert not cpu_causal_attention.serves(q48, k48, v48)
    q3, k3, v3 = projection(8, 3, 2, 64)  # 3 query heads over 2 KV heads: no whole groups
    assert not cpu_causal_attention.serves(q3, k3, v3)


@runs_here
def test_the_prefill_dispatcher_runs_it_for_a_chunk_without_prefix(monkeypatch):
    q, k, v = projection(20, 4, 2, 64, seed=5)
    block_size, blocks = 16, 4
    cache = torch.zeros(blocks, 2, block_size, 2, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    calls = []
    real = cpu_causal_attention.causal_attention
    monkeypatch.setattr(cpu_causal_attention, "causal_attention", lambda *a: calls.append(1) or real(*a))
    got = kernels.paged_attention_prefill(q, cache, tables, starts, lens, 0.125, key=k, value=v)
    assert calls == [1]
    torch.testing.assert_close(got, real(q, k, v, 0.125), rtol=0, atol=0)
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")  # the reference: SDPA
    forced = kernels.paged_attention_prefill(q, cache, tables, starts, lens, 0.125, key=k, value=v)
    assert calls == [1]
    torch.testing.assert_close(forced.float(), got.float(), rtol=2**-6, atol=2**-5)


@runs_here
@pytest.mark.parametrize("length", [17, 64, 100, 301])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 64, 200])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_with_a_window_it_gives_what_sdpa_gives(length, window, heads, head_dim):
    """Windows of one key, within a tile of 16, a tile, across tiles: SDPA with the window's
    mask (``causal_self_attention_ref``) to the same bounds as without a window."""
    q, k, v = projection(length, *heads, head_dim, seed=length + window)
    scale = head_dim**-0.5
    got = cpu_causal_attention.causal_attention(q, k, v, scale, sliding_window=window)
    want = reference.causal_self_attention_ref(q, k, v, scale, sliding_window=window)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5)
    exact = reference.causal_self_attention_ref(q.float(), k.float(), v.float(), scale, sliding_window=window)
    ours, sdpas = (got.float() - exact).abs().max(), (want.float() - exact).abs().max()
    assert ours <= sdpas * 1.5 + 1e-3, (ours, sdpas)


@runs_here
def test_a_row_attends_to_its_window_only():
    """Window 10: rows from 29 on do not see positions 0..19 (their values changed: the same
    bits); row 28 sees position 19."""
    q, k, v = projection(60, 4, 2, 64, seed=4)
    windowed = cpu_causal_attention.causal_attention(q, k, v, 0.125, sliding_window=10)
    changed = v.clone()
    changed[:20] = 100.0
    again = cpu_causal_attention.causal_attention(q, k, changed, 0.125, sliding_window=10)
    assert torch.equal(windowed[29:], again[29:])
    assert not torch.equal(windowed[28], again[28])
    one = cpu_causal_attention.causal_attention(q, k, v, 0.125, sliding_window=1)
    assert torch.equal(one, v.repeat_interleave(2, dim=1))  # one key each: its own value, exactly


@runs_here
def test_no_window_or_one_holding_the_chunk_changes_no_bit():
    q, k, v = projection(100, 9, 3, 64, seed=6)
    today = cpu_causal_attention.causal_attention(q, k, v, 0.125)
    for window in (None, 0, 100, 4096):
        again = cpu_causal_attention.causal_attention(q, k, v, 0.125, sliding_window=window)
        assert torch.equal(again, today), window


@runs_here
def test_the_prefill_dispatcher_runs_it_with_the_window(monkeypatch):
    q, k, v = projection(40, 4, 2, 64, seed=7)
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    windows = []
    real = cpu_causal_attention.causal_attention
    monkeypatch.setattr(
        cpu_causal_attention,
        "causal_attention",
        lambda *a, **kw: windows.append(kw.get("sliding_window")) or real(*a, **kw),
    )
    for window in (9, 40, None):
        got = kernels.paged_attention_prefill(
            q, cache, tables, starts, lens, 0.125, key=k, value=v, sliding_window=window
        )
        assert torch.equal(got, real(q, k, v, 0.125, sliding_window=window))
    assert windows == [9, None, None]  # a window holding the chunk is no window


@runs_here
@pytest.mark.parametrize(("prefix", "q_len"), [(1, 1), (16, 5), (17, 16), (100, 64), (512, 37), (301, 301)])
@pytest.mark.parametrize("window", [0, 7, 64])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_chunk_after_its_prefix_gets_the_last_rows_of_the_whole_prompts_attention(
    prefix, q_len, window, heads, head_dim
):
    """A later chunk of a prompt (its queries the last ``q_len`` of ``prefix + q_len`` keys) gets,
    bit for bit, the rows the whole prompt's attention gives those positions: each row sees the
    same keys in the same order, whatever rows it is computed with. So the bounds above against
    SDPA hold for it too, and the chunk's split never changes a prefill's result."""
    q, k, v = projection(prefix + q_len, *heads, head_dim, seed=prefix + q_len + window)
    scale = head_dim**-0.5
    whole = cpu_causal_attention.causal_attention(q, k, v, scale, sliding_window=window)
    chunk_q = q[prefix:]
    assert cpu_causal_attention.serves(chunk_q, k, v)
    got = cpu_causal_attention.causal_attention(chunk_q, k, v, scale, sliding_window=window)
    assert got.shape == (q_len, heads[0], head_dim)
    assert torch.equal(got, whole[prefix:])
    want = reference.causal_self_attention_ref(q, k, v, scale, sliding_window=window)[prefix:]
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5)


@runs_here
@pytest.mark.parametrize("window", [None, 24])
def test_the_prefill_dispatcher_runs_it_for_a_chunk_after_its_cached_prefix(monkeypatch, window):
    """Chunks of 20 and 5 queries after prefixes of 44 and 30 positions, their K/V in the paged
    cache: the kernel over the gathered K/V, the masked SDPA's result to the same bounds."""
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 64
    lengths, q_lens = [64, 35], [20, 5]
    cache = torch.zeros(10, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]], dtype=torch.int32)
    queries, wants = [], []
    for seq, (length, q_len) in enumerate(zip(lengths, q_lens, strict=True)):
        q, k, v = projection(length, heads, kv_heads, head_dim, seed=11 + seq)
        for pos in range(length):
            block, offset = int(tables[seq, pos // block_size]), pos % block_size
            cache[block, 0, offset], cache[block, 1, offset] = k[pos], v[pos]
        queries.append(q[length - q_len :])
        wants.append(
            cpu_causal_attention.causal_attention(q, k, v, 0.125, sliding_window=window)[length - q_len :]
        )
    query = torch.cat(queries).contiguous()
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    calls = []
    real = cpu_causal_attention.causal_attention
    monkeypatch.setattr(
        cpu_causal_attention, "causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    got = kernels.paged_attention_prefill(query, cache, tables, starts, lens, 0.125, sliding_window=window)
    assert len(calls) == 2
    assert torch.equal(got, torch.cat(wants))
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")  # the reference: gathered K/V, masked SDPA
    forced = kernels.paged_attention_prefill(query, cache, tables, starts, lens, 0.125, sliding_window=window)
    assert len(calls) == 2
    torch.testing.assert_close(forced.float(), got.float(), rtol=2**-6, atol=2**-5)
