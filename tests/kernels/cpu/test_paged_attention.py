"""The C decode attention (``kernels/cpu/csrc/paged_attention.c``) against the torch reference.

Same inputs, same attention: fp32 to float rounding, bf16 to one rounding of the output. Shapes
cover what the kernel branches on: head_dim a multiple of 16 (the AVX-512 path), of 8 (the AVX2
path on a CPU without AVX-512) or neither (the portable loop), GQA groups of 1 to 4 heads, contexts of one token, exactly a block, and a block
plus one, and the engine's real cache view (a layer of a cache that holds every layer per block).
"""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import paged_attention as cpu_attention
from pdserve.kernels.cpu.features import cpu_flags

# Only a missing compiler skips: a source that fails to build must fail here, not fall back quietly.
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")


def _case(seed: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
          lens: list[int], dtype: torch.dtype, num_layers: int = 3):  # fmt: skip
    """Queries, one layer's view of an all-layers cache, random block tables, the lengths."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    cache = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen).to(
        dtype
    )
    layer = cache[:, 1]  # not contiguous: a block's other layers lie between two of its views
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return query, layer, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 32), (8, 2, 48), (6, 3, 20)],
    ids=["smollm-gqa3", "mha", "gqa4-dim48", "dim20-portable"],
)
@pytest.mark.parametrize("block_size", [16, 8])
def test_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    assert cpu_attention.KERNELS.available()
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 37]
    query, layer, tables, seq_lens = _case(
        0, len(lens), num_heads, num_kv_heads, head_dim, block_size, lens, dtype
    )
    want = reference.paged_attention_decode_ref(query, layer, tables, seq_lens, 0.125)
    got = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # both sum in fp32; the outputs may differ by a rounding to bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-3)


def test_threads_split_the_work_without_changing_a_result():
    lens = [300, 17, 129, 64, 1, 250, 90, 33]
    query, layer, tables, seq_lens = _case(1, len(lens), 9, 3, 64, 16, lens, torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each (sequence, KV head) is one task, summed the same way


def test_the_dispatcher_runs_it_for_bf16_caches_and_fp32_ones_its_vectors_take(monkeypatch):
    """bf16 caches always; fp32 caches where the AVX-512 or AVX2 path takes the head size (the
    portable loop loses to SDPA in fp32); ``PDSERVE_KERNELS=torch`` forces the reference."""
    lens = [40, 3]
    calls = []
    real = cpu_attention.paged_attention_decode
    monkeypatch.setattr(cpu_attention, "paged_attention_decode", lambda *a: calls.append(1) or real(*a))
    lanes = cpu_attention.vector_lanes()
    for dtype, head_dim, expected_calls in (
        (torch.bfloat16, 64, 1),
        (torch.bfloat16, 20, 1),
        (torch.float32, 64, int(lanes > 0)),
        (torch.float32, 20, 0),  # no vector path for 20
    ):
        calls.clear()
        query, layer, tables, seq_lens = _case(2, len(lens), 9, 3, head_dim, 16, lens, dtype)
        kernels.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
        assert len(calls) == expected_calls, (dtype, head_dim)
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")  # forces the reference
    calls.clear()
    query, layer, tables, seq_lens = _case(2, len(lens), 9, 3, 64, 16, lens, torch.bfloat16)
    kernels.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    assert calls == []


def test_the_vector_path_fits_this_cpu():
    """16 lanes with AVX-512, 8 with AVX2 (and FMA): a machine of either kind runs its own."""
    flags = cpu_flags()
    expected = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 0
    assert cpu_attention.vector_lanes() == expected


def test_a_sequence_attends_alike_whatever_it_is_batched_with():
    """fp32: one task per sequence, so its result is bit-identical alone and in a batch."""
    lens = [300, 17, 129, 64]
    query, layer, tables, seq_lens = _case(4, len(lens), 9, 3, 64, 16, lens, torch.float32)
    batch = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    for i in range(len(lens)):
        alone = cpu_attention.paged_attention_decode(
            query[i : i + 1], layer, tables[i : i + 1], seq_lens[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batch[i])


def test_without_the_library_the_reference_runs(monkeypatch):
    monkeypatch.setattr(cpu_attention.KERNELS, "_library", None)
    monkeypatch.setattr(cpu_attention.KERNELS, "_load_error", "no C compiler (cc, gcc or clang) on PATH")
    lens = [20]
    query, layer, tables, seq_lens = _case(3, 1, 9, 3, 64, 16, lens, torch.bfloat16)
    assert not cpu_attention.serves(query, layer)
    out = kernels.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    assert torch.equal(out, reference.paged_attention_decode_ref(query, layer, tables, seq_lens, 0.125))


# Sliding windows against the contexts of `lens` below: one position, mid-block, exactly a
# block (window starts on block boundaries), several blocks, 37 (a whole context) and beyond
# every context.
def _windows(block_size: int) -> list[int]:
    return [1, 5, block_size, 2 * block_size + 3, 37, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 32), (8, 2, 48), (6, 3, 20)],
    ids=["smollm-gqa3", "mha", "gqa4-dim48", "dim20-portable"],
)
@pytest.mark.parametrize("block_size", [16, 8])
def test_a_sliding_window_matches_the_windowed_reference(
    dtype, num_heads, num_kv_heads, head_dim, block_size
):
    """A batch of contexts from 1 to 200 positions, each window from 1 position to more than
    the longest context: the kernel's attention is the reference's (same tolerances as above)."""
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 37, 200]
    query, layer, tables, seq_lens = _case(
        5, len(lens), num_heads, num_kv_heads, head_dim, block_size, lens, dtype
    )
    for window in _windows(block_size):
        want = reference.paged_attention_decode_ref(
            query, layer, tables, seq_lens, 0.125, sliding_window=window
        )
        got = cpu_attention.paged_attention_decode(
            query, layer, tables, seq_lens, 0.125, sliding_window=window
        )
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"window {window}")
        else:
            torch.testing.assert_close(
                got.float(), want.float(), rtol=2**-7, atol=2e-3, msg=f"window {window}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 20], ids=["vector", "portable"])
def test_a_window_reads_nothing_before_it(dtype, head_dim):
    """Every position before a sequence's window poisoned with NaN (whole blocks before it, and
    the start of the block it begins in): the same bits as the clean cache, so the kernel never
    reads them, and the output differs from full attention's."""
    block_size, window = 16, 21
    lens = [300, 17, 129, 64, 1, 250, 90, 22]
    query, layer, tables, seq_lens = _case(6, len(lens), 9, 3, head_dim, block_size, lens, dtype)
    clean = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125, sliding_window=window)
    poisoned = layer.clone()
    for seq, length in enumerate(lens):
        for pos in range(max(0, length - window)):
            poisoned[int(tables[seq, pos // block_size]), :, pos % block_size] = float("nan")
    got = cpu_attention.paged_attention_decode(
        query, poisoned, tables, seq_lens, 0.125, sliding_window=window
    )
    assert torch.equal(got, clean)
    full = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    assert not torch.equal(full[0], clean[0]) and torch.equal(full[4], clean[4])  # 300 positions; 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 20], ids=["vector", "portable"])
def test_no_window_or_one_holding_every_context_changes_no_bit(dtype, head_dim):
    lens = [300, 17, 129, 64, 1, 250, 90, 33]
    query, layer, tables, seq_lens = _case(7, len(lens), 9, 3, head_dim, 16, lens, dtype)
    today = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125)
    for window in (None, 0, 300, 4096):
        again = cpu_attention.paged_attention_decode(
            query, layer, tables, seq_lens, 0.125, sliding_window=window
        )
        assert torch.equal(again, today), window


def test_a_windowed_sequence_attends_alike_whatever_it_is_batched_with():
    lens = [300, 17, 129, 64]
    query, layer, tables, seq_lens = _case(8, len(lens), 9, 3, 64, 16, lens, torch.float32)
    batch = cpu_attention.paged_attention_decode(query, layer, tables, seq_lens, 0.125, sliding_window=40)
    for i in range(len(lens)):
        alone = cpu_attention.paged_attention_decode(
            query[i : i + 1], layer, tables[i : i + 1], seq_lens[i : i + 1], 0.125, sliding_window=40
        )
        assert torch.equal(alone[0], batch[i])


def test_the_dispatcher_passes_the_window_to_the_kernel(monkeypatch):
    lens = [90, 3]
    query, layer, tables, seq_lens = _case(9, len(lens), 9, 3, 64, 16, lens, torch.bfloat16)
    windows = []
    real = cpu_attention.paged_attention_decode
    monkeypatch.setattr(
        cpu_attention,
        "paged_attention_decode",
        lambda *a, **k: windows.append(k.get("sliding_window")) or real(*a, **k),
    )
    got = kernels.paged_attention_decode(query, layer, tables, seq_lens, 0.125, sliding_window=20)
    assert windows == [20]
    torch.testing.assert_close(
        got.float(),
        reference.paged_attention_decode_ref(
            query, layer, tables, seq_lens, 0.125, sliding_window=20
        ).float(),
        rtol=2**-7,
        atol=2e-3,
    )
    kernels.paged_attention_decode(query, layer, tables, seq_lens, 0.125, sliding_window=None)
    assert windows == [20, None]  # no window: the call made before windows existed
