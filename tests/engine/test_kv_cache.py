"""Block pool and KV cache manager: ref counts, LRU eviction, chained hashes, allocation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv_cache import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
    hash_request_blocks,
)
from pdserve.engine.request import Request, SamplingParams

BLOCK = 4


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8))


def _schedule_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a new request: take the cached prefix, allocate the rest."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    assert new_ids is not None
    manager.record_prefix_query(request.num_tokens, num_hit_tokens)  # admitted: counted once
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)


def _free_queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def _assert_pool_consistent(pool: BlockPool) -> None:
    free_ids = _free_queue_ids(pool)
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for block_hash, blocks in pool.cached_block_hash_to_block.items():
        for block_id, block in blocks.items():
            assert block.block_id == block_id and block.block_hash == block_hash


# ------------------------------------------------------------------------------ free queue


def test_free_queue_pops_in_insertion_order():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 4
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()


def test_free_queue_removes_from_head_middle_and_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3]
    assert queue.num_free_blocks == 2
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 2, 0]
    assert queue.popleft() is blocks[1]
    assert queue.num_free_blocks == 3


def test_removing_a_block_not_in_the_queue_is_caught():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 7)), max_size=60))
def test_free_queue_matches_a_list_model(ops):
    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(range(8))
    for op, block_id in ops:
        if op == "pop" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "remove" and block_id in model:
            queue.remove(blocks[block_id])
            model.remove(block_id)
        elif op == "append" and block_id not in model:
            queue.append(blocks[block_id])
            model.append(block_id)
        assert [b.block_id for b in queue] == model
        assert queue.num_free_blocks == len(model)


# ------------------------------------------------------------------------------ hashes


def test_block_hash_chains_the_parent():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    again = hash_block_tokens(None, (1, 2, 3, 4))
    assert first == again
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second.token_ids == (5, 6, 7, 8)
    # The same tokens at another position in another prefix are another block.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != second
    assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != second


def test_request_hashes_cover_full_blocks_only_and_extend_incrementally():
    tokens = list(range(10))
    hashes = hash_request_blocks(tokens, BLOCK, [])
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    tokens += [10, 11]
    extended = hash_request_blocks(tokens, BLOCK, hashes)
    assert extended is hashes
    assert len(hashes) == 3
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])


def test_same_block_tokens_in_a_different_prefix_position_miss_the_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _schedule_prefill(manager, a)
    manager.free(a)
    # b's first block holds a's second block's tokens: no hit.
    b = _request("b", [5, 6, 7, 8, 1, 2, 3, 4, 9])
    assert manager.get_computed_blocks(b) == ([], 0)


# ------------------------------------------------------------------------------ block pool


def test_new_pool_is_all_free_and_unused():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert _free_queue_ids(pool) == [0, 1, 2, 3]


def test_usage_is_the_fraction_of_blocks_in_use():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.25)
    more = pool.get_new_blocks(4)
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(blocks + more)
    assert pool.usage == 0.0


def test_getting_more_blocks_than_free_fails_and_changes_nothing():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i] * BLOCK) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    # Freed in the order 1, 2, 0: block 1 is the least recently freed.
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0]])
    assert _free_queue_ids(pool) == [1, 2, 0]
    assert all(pool.get_cached_block(h) is not None for h in hashes)

    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[1]
    assert evicted.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[2]
    _assert_pool_consistent(pool)


def test_a_requests_blocks_are_freed_tail_first():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK, max_model_len=64)
    request = _request("r", list(range(12)))
    block_ids = _schedule_prefill(manager, request)
    assert len(block_ids) == 3
    manager.free(request)
    # The tail of the prefix is evicted before its head (the head is the most shareable part).
    queue = _free_queue_ids(manager.block_pool)
    assert queue[-3:] == list(reversed(block_ids))


def test_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_block_tokens(None, [7] * BLOCK)], 0, 1)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert block.block_id not in _free_queue_ids(pool)
    # Touching a block in use only adds a reference.
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    assert block.block_hash is not None  # still cached while free
    _assert_pool_consistent(pool)


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_caching_an_already_cached_block_is_caught():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1] * BLOCK)
    pool.cache_full_blocks([block], [block_hash], 0, 1)
    with pytest.raises(AssertionError):
        pool.cache_full_blocks([block], [block_hash], 0, 1)
    pool.free_blocks([block])


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, max_model_len=64)
    request = _request("r", list(range(9)))
    _schedule_prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.block_pool.cached_block_hash_to_block  # the prefix stays cached after free
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    assert manager.get_computed_blocks(_request("again", list(range(9)))) == ([], 0)


# ------------------------------------------------------------------------------ manager


def test_shared_prefix_blocks_are_reference_counted():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64)
    a = _request("a", list(range(10)))
    a_blocks = _schedule_prefill(manager, a)
    b = _request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert [h.block_id for h in hits] == a_blocks[:2]
    b_blocks = _schedule_prefill(manager, b)
    assert b_blocks[:2] == a_blocks[:2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    assert manager.usage == pytest.approx(4 / 8)  # 2 shared + a's tail + b's tail

    manager.free(a)
    assert [manager.block_pool.blocks[i].ref_cnt for i in a_blocks] == [1, 1, 0]
    assert manager.usage == pytest.approx(3 / 8)
    manager.free(b)
    assert manager.usage == 0.0
    _assert_pool_consistent(manager.block_pool)


def test_the_last_prompt_token_is_never_a_cache_hit():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64)
    a = _request("a", list(range(8)))
    _schedule_prefill(manager, a)
    manager.free(a)
    # Both of a's blocks are cached, but the same 8 tokens may only hit the first block.
    hits, num_hit_tokens = manager.get_computed_blocks(_request("b", list(range(8))))
    assert num_hit_tokens == 4 and len(hits) == 1
    hits, num_hit_tokens = manager.get_computed_blocks(_request("c", list(range(9))))
    assert num_hit_tokens == 8 and len(hits) == 2


def test_prefix_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64, enable_caching=False)
    a = _request("a", list(range(9)))
    _schedule_prefill(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK, max_model_len=64)
    request = _request("r", list(range(13)))  # needs 4 blocks
    assert manager.allocate_slots(request, 13) is None
    assert manager.num_free_blocks == 3
    assert manager.get_block_ids("r") == []
    assert manager.usage == 0.0
    manager.free(request)


def test_allocate_slots_grows_the_block_table_one_block_at_a_time():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64)
    request = _request("r", list(range(7)))
    assert len(manager.allocate_slots(request, 7)) == 2
    request.num_computed_tokens = 7
    request.append_output_token_ids(100)
    assert manager.allocate_slots(request, 1) == []  # slot 7 is in block 1
    request.num_computed_tokens = 8
    request.append_output_token_ids(101)
    new = manager.allocate_slots(request, 1)
    assert len(new) == 1
    assert manager.get_block_ids("r")[-1] == new[0]
    manager.free(request)
    assert manager.usage == 0.0


def test_free_cache_hits_are_not_counted_twice_as_free_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, max_model_len=64)
    a = _request("a", list(range(9)))
    _schedule_prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4  # two of them cached

    # b hits both cached blocks and needs 3 more: 5 blocks > 4 in the pool.
    too_big = _request("b", list(range(8)) + list(range(100, 110)))
    hits, num_hit_tokens = manager.get_computed_blocks(too_big)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(too_big, too_big.num_tokens - 8, 8, hits) is None
    assert manager.num_free_blocks == 4
    assert all(block.ref_cnt == 0 for block in hits)
    manager.free(too_big)

    # c hits both and needs 2 more: exactly the pool.
    fits = _request("c", list(range(8)) + list(range(100, 106)))
    hits, num_hit_tokens = manager.get_computed_blocks(fits)
    assert manager.allocate_slots(fits, fits.num_tokens - 8, 8, hits) is not None
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    manager.free(fits)
    assert manager.usage == 0.0
    _assert_pool_consistent(manager.block_pool)


def test_evicting_a_cached_block_removes_it_from_the_prefix_cache():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK, max_model_len=64)
    a = _request("a", list(range(5)))
    _schedule_prefill(manager, a)
    manager.free(a)
    assert manager.get_computed_blocks(_request("probe", list(range(5))))[1] == 4
    other = _request("other", list(range(100, 108)))  # takes both blocks, evicting a's
    _schedule_prefill(manager, other)
    manager.free(other)
    assert manager.get_computed_blocks(_request("probe2", list(range(5))))[1] == 0


def test_prefix_cache_stats_count_queried_and_hit_tokens_cumulatively():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, max_model_len=64)
    a = _request("a", list(range(9)))
    _schedule_prefill(manager, a)  # 9 queried, 0 hit
    b = _request("b", list(range(9)))
    _schedule_prefill(manager, b)  # 9 queried, 8 hit
    stats = manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (18, 8)
    # Reading does not reset: two readers (step stats, the Stats RPC) see the same totals.
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (18, 8)
    manager.free(a)
    manager.free(b)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 14)),
        min_size=1,
        max_size=40,
    )
)
def test_random_allocate_and_free_keeps_the_pool_consistent(ops):
    """Requests from a few shared prefixes come and go; counts, queue and index always agree."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK, max_model_len=64)
    live: dict[str, Request] = {}
    for n, (allocate, prefix, length) in enumerate(ops):
        if allocate or not live:
            tokens = [prefix * 100 + i for i in range(length)]
            request = _request(f"r{n}", tokens)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
            if ids is None:
                manager.free(request)
            else:
                live[request.request_id] = request
                assert manager.num_blocks_of(request.request_id) == -(-length // BLOCK)
        else:
            manager.free(live.pop(next(iter(live))))
        _assert_pool_consistent(manager.block_pool)
        in_use = sum(1 for b in manager.block_pool.blocks if b.ref_cnt > 0)
        assert manager.usage == pytest.approx(in_use / 10)
    for request in live.values():
        manager.free(request)
    assert manager.usage == 0.0
    _assert_pool_consistent(manager.block_pool)
