"""Decode attention batched by groups of similar context length: the groups cover every
sequence once, keep padding within bounds, and give the same attention as one padded batch."""

from __future__ import annotations

import math

import torch

from pdserve.kernels import reference, scratch


def test_decode_length_groups_partition_and_bound_padding():
    lens = [700, 3, 40, 41, 39, 1200, 38, 5, 650, 42, 1]
    groups = reference.decode_length_groups(lens)
    assert sorted(i for group in groups for i in group) == list(range(len(lens)))
    for group in groups:
        members = [lens[i] for i in group]
        assert members == sorted(members)
        limit = reference.DECODE_GROUP_PADDING * sum(members) + reference.DECODE_GROUP_SLACK
        assert len(members) * max(members) <= limit
    # Short contexts share one group; the long tail does not pad them to 1200.
    assert [[lens[i] for i in g] for g in groups] == [[1, 3, 5, 38, 39, 40, 41, 42], [650, 700, 1200]]
    assert reference.decode_length_groups([17] * 9) == [list(range(9))]


def test_grouped_decode_equals_one_padded_batch():
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, heads, head_dim = 4, 2, 6, 8
    lens = [2, 610, 5, 7, 300, 6, 640, 1, 33]
    blocks = [math.ceil(n / block_size) for n in lens]
    cache = torch.randn(sum(blocks) + 1, 2, block_size, num_kv_heads, head_dim, generator=gen).double()
    perm = torch.randperm(cache.shape[0], generator=gen)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for seq, n in enumerate(blocks):
        tables[seq, :n] = perm[used : used + n]
        used += n
    query = torch.randn(len(lens), heads, head_dim, generator=gen).double()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert len(reference.decode_length_groups(lens)) > 1
    grouped = reference.paged_attention_decode_ref(query, cache, tables, seq_lens, 0.3)
    # One padded batch: the same op with every sequence in one group.
    reference.DECODE_GROUP_SLACK, slack = 10**9, reference.DECODE_GROUP_SLACK
    try:
        assert len(reference.decode_length_groups(lens)) == 1
        padded = reference.paged_attention_decode_ref(query, cache, tables, seq_lens.clone(), 0.3)
    finally:
        reference.DECODE_GROUP_SLACK = slack
    torch.testing.assert_close(grouped, padded, rtol=1e-12, atol=1e-12)


def test_gather_scratch_buffer_serves_calls_inside_and_outside_inference_mode():
    """The reused gather buffer is first sized inside inference_mode (as the runner calls the
    kernels), then used bare (as tests and benchmarks do), and each call sees its own data."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 2, 4, 1, 8, generator=gen)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]], dtype=torch.int32)
    query = torch.randn(2, 2, 8, generator=gen)
    seq_lens = torch.tensor([16, 7], dtype=torch.int32)
    scratch._local.__dict__.pop("buffers", None)  # start with no buffer
    with torch.inference_mode():
        inside = reference.paged_attention_decode_ref(query, cache, tables, seq_lens, 0.3)
    outside = reference.paged_attention_decode_ref(query, cache, tables, seq_lens, 0.3)
    assert not any(buffer.is_inference() for buffer in scratch._local.buffers.values())
    torch.testing.assert_close(inside, outside)
    other = reference.paged_attention_decode_ref(query, cache.flip(0), tables, seq_lens, 0.3)
    assert not torch.allclose(other, outside)
    torch.testing.assert_close(
        reference.paged_attention_decode_ref(query, cache, tables, seq_lens, 0.3), outside
    )


def test_decode_plan_is_built_once_per_batch_and_rebuilt_when_it_changes():
    """Every layer of a forward pass gets the same batch: one plan serves them all, and a
    changed batch (even the same tensors written in place) gets a new plan. The runner builds
    its metadata under inference_mode, so these are inference tensors (no version counter)."""
    with torch.inference_mode():
        tables = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 0]], dtype=torch.int32)
        seq_lens = torch.tensor([40, 3, 20], dtype=torch.int32)
        plan = reference._decode_plan(tables, seq_lens, 16)
        assert reference._decode_plan(tables, seq_lens, 16) is plan
        assert reference._decode_plan(tables.clone(), seq_lens.clone(), 16) is plan
        seq_lens[1] += 1
        replanned = reference._decode_plan(tables, seq_lens, 16)
        assert replanned is not plan
        tables[2, 1] = 6
        assert reference._decode_plan(tables, seq_lens, 16) is not replanned
        assert reference._decode_plan(tables, seq_lens, 8) is not replanned


def test_llm_decodes_mixed_lengths_like_each_request_alone(tiny_llm):
    """Through the engine (metadata built under inference_mode), a batch of decodes whose
    contexts fall into several length groups gives each request its solo greedy tokens."""
    from pdserve.engine.request import SamplingParams

    lengths = [5, 600, 9, 300, 620, 2]
    prompts = [[100 + (i * 7 + j) % 150 for j in range(n)] for i, n in enumerate(lengths)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert len(reference.decode_length_groups([n + 1 for n in lengths])) > 1
    together = [c.token_ids for c in tiny_llm.generate(prompts, greedy)]
    alone = [tiny_llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert together == alone
    assert tiny_llm.engine.scheduler.kv_cache_manager.usage == 0.0
