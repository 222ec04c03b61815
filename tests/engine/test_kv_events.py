"""KV-cache events from the block pool, and their wire format (vLLM's ``KVEventBatch``).

No model and no engine process: a block pool driven by a KV cache manager, and a publisher on
loopback ports read by a ZMQ subscriber.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from pdserve.engine.kv_cache import KVCacheManager, hash_request_blocks
from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
)
from pdserve.engine.request import Request, SamplingParams
from pdserve.supervisor import pick_free_ports
from tests.helpers.kv_events import replay_batches

BLOCK = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def _run(manager: KVCacheManager, request: Request) -> None:
    """Admit ``request`` with its prefix hits, compute its whole prompt, finish it."""
    computed, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, computed) is not None
    manager.free(request)


def _stored(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def _removed(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_stored_events_carry_the_hashes_the_router_computes_for_the_prompt():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, max_model_len=64)
    manager.block_pool.enable_events()
    assert isinstance(manager.block_pool.take_events()[0], AllBlocksCleared)
    tokens = list(range(100, 113))  # 3 full blocks and one token
    _run(manager, _request("a", tokens))
    events = manager.block_pool.take_events()
    router_hashes = [h.hash_value for h in hash_request_blocks(tokens, BLOCK, [])]
    assert _stored(events) == router_hashes
    (stored,) = events
    assert stored.parent_block_hash is None and stored.block_size == BLOCK
    assert stored.token_ids == tokens[:12]

    # The same prefix again: a hit, nothing new; a longer prompt stores only its new block,
    # with the last shared block as its parent.
    _run(manager, _request("b", tokens[:12] + [7, 7, 7, 7, 7]))
    (stored,) = manager.block_pool.take_events()
    assert stored.parent_block_hash == router_hashes[-1] and stored.token_ids == [7, 7, 7, 7]


def test_evicted_blocks_are_reported_removed_once_their_last_copy_is_reused():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, max_model_len=64)
    manager.block_pool.enable_events()
    manager.block_pool.take_events()
    first = list(range(16))
    _run(manager, _request("a", first))
    first_hashes = _stored(manager.block_pool.take_events())
    _run(manager, _request("b", list(range(50, 66))))  # needs every block: evicts all of "a"
    events = manager.block_pool.take_events()
    assert sorted(_removed(events)) == sorted(first_hashes)
    assert len(_stored(events)) == 4
    assert manager.reset_prefix_cache()
    assert isinstance(manager.block_pool.take_events()[-1], AllBlocksCleared)


def test_snapshot_lists_every_cached_hash_after_a_clear():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, max_model_len=64)
    manager.block_pool.enable_events()
    _run(manager, _request("a", list(range(16))))
    stored = _stored(manager.block_pool.take_events())
    snapshot = manager.block_pool.snapshot_events()
    assert isinstance(snapshot[0], AllBlocksCleared)
    assert sorted(_stored(snapshot)) == sorted(stored)


def test_batches_encode_as_vllms_array_like_struct_of_tagged_maps():
    batch = EventBatch(
        1.5, [BlockStored([-5, 7], None, [1, 2, 3, 4], 2), BlockRemoved([7]), AllBlocksCleared()]
    )
    plain = msgpack.unpackb(encode_batch(batch))
    assert plain[0] == 1.5 and plain[2] is None
    assert plain[1][0] == {
        "type": "BlockStored",
        "block_hashes": [-5, 7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert plain[1][1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    assert plain[1][2] == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(ValueError, match="malformed"):
        decode_batch(b"\x93\x01")


def test_publisher_numbers_batches_and_replays_from_a_sequence_number():
    port, _ = pick_free_ports("127.0.0.1", 2)
    publisher = KVEventPublisher("127.0.0.1", port, port + 1, buffer_steps=3)
    ctx = zmq.Context()
    try:
        for i in range(5):
            publisher.publish(EventBatch(float(i), [BlockRemoved([i])]))
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{port + 1}")

        def ask(start: int) -> list[int]:
            batches = replay_batches(replay, start)
            for seq, batch in batches:
                assert batch.events == [BlockRemoved([seq])]
            return [seq for seq, _ in batches]

        assert ask(3) == [3, 4]
        assert not publisher.snapshot_wanted.is_set()
        assert ask(0) == [2, 3, 4]  # 0 and 1 left the 3-batch buffer
        assert publisher.snapshot_wanted.is_set()
        replay.close(linger=0)
    finally:
        publisher.close()
        ctx.term()
    # Its replay thread waits for requests with no timeout; ``close`` wakes it, and it ends.
    assert not publisher._thread.is_alive()
    publisher.close()  # a second close is harmless
