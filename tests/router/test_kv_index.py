"""The router's side of KV events, without engines: the index, the stream's replay and resync,
and the ``kv`` policy's choice.

A ``KVEventPublisher`` on loopback ports stands in for an engine (it is the engine's own
publisher); the router's ``EngineEventStream`` reads it in an asyncio loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventPublisher
from pdserve.router.engines import EngineHandle
from pdserve.router.kv_index import KVBlockIndex, PendingBlocks
from pdserve.router.kv_subscriber import KVEventTracker
from pdserve.router.policies import RoutingPolicy
from pdserve.supervisor import pick_free_ports

ENGINE = "127.0.0.1:1"  # the router knows engines by gRPC address; events go to its host


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, [0] * 4 * len(hashes), 4)


def test_index_matches_leading_blocks_only_and_forgets_an_engine_at_once():
    index = KVBlockIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 3])
    assert index.matched_blocks("a", [1, 2, 3, 4]) == 3
    assert index.matched_blocks("b", [1, 2, 3]) == 1  # a hit must be a prefix
    index.remove("a", [2])
    assert index.matched_blocks("a", [1, 2, 3]) == 1
    assert index.engines_of[1] == {"a", "b"}
    index.clear("b")
    assert index.engines_of == {1: {"a"}, 3: {"a"}} and "b" not in index.hashes_of


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_stream_replays_a_lost_batch_and_resyncs_from_a_snapshot_when_the_buffer_is_short(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_EVENTS_DROP_SEQS", "2")
    port, replay_port = pick_free_ports("127.0.0.1", 2)
    publisher = KVEventPublisher("127.0.0.1", port, replay_port, buffer_steps=4)

    async def scenario() -> None:
        tracker = KVEventTracker()
        publisher.publish(EventBatch(0.0, [AllBlocksCleared()]))  # seq 0
        tracker.engine_up(ENGINE, "instance-1", port, replay_port)
        await _until(lambda: tracker.in_sync(ENGINE))
        publisher.publish(EventBatch(0.0, [_stored(1, 2)]))  # seq 1
        publisher.publish(EventBatch(0.0, [_stored(3)]))  # seq 2: lost on the PUB socket
        publisher.publish(EventBatch(0.0, [BlockRemoved([1])]))  # seq 3: the gap shows
        stream = tracker.streams[ENGINE]
        await _until(lambda: stream.expected == 4)
        assert stream.num_replays == 1 and stream.num_resyncs == 0
        assert tracker.index.hashes_of[ENGINE] == {2, 3}

        # A router that starts late, after the 4-batch buffer dropped seq 0 and 1.
        for i in range(3):
            publisher.publish(EventBatch(0.0, [_stored(10 + i)]))  # seq 4..6
        late = KVEventTracker()
        late.engine_up(ENGINE, "instance-1", port, replay_port)
        await _until(lambda: publisher.snapshot_wanted.is_set())
        late_stream = late.streams[ENGINE]
        await _until(lambda: late_stream.num_resyncs == 1)
        assert not late.in_sync(ENGINE)  # a subset only, until the snapshot
        publisher.snapshot_wanted.clear()
        snapshot = [AllBlocksCleared(), _stored(2), _stored(3), _stored(10), _stored(11), _stored(12)]
        publisher.publish(EventBatch(0.0, snapshot))  # what the engine core sends next
        await _until(lambda: late.in_sync(ENGINE))
        assert late.index.hashes_of[ENGINE] == {2, 3, 10, 11, 12}

        # Restarted (a new instance id): its entries go at once.
        tracker.engine_up(ENGINE, "instance-2", 0, 0)
        assert ENGINE not in tracker.index.hashes_of
        tracker.close()
        late.close()

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def _engine(role: str, address: str, in_flight: int = 0) -> EngineHandle:
    unused: Any = None
    return EngineHandle(
        role, address, channel=unused, stub=unused, health=unused, healthy=True, in_flight=in_flight
    )


class _InSync(KVEventTracker):
    def in_sync(self, address: str) -> bool:
        return True


def test_kv_policy_weighs_matched_blocks_against_load_and_falls_back_to_prefix_until_in_sync():
    tracker = _InSync()
    tracker.index.store("d0", [1, 2, 3, 4])
    tracker.index.store("d1", [1])
    d0, d1 = _engine("decode", "d0", in_flight=2), _engine("decode", "d1", in_flight=1)
    policy = RoutingPolicy("kv", tracker, load_weight=1.0)
    assert policy.pick([d0, d1], [1, 2, 3, 4]).address == "d0"  # 4 - 2 > 1 - 1
    assert (
        RoutingPolicy("kv", tracker, load_weight=4.0).pick([d0, d1], [1, 2, 3, 4]).address == "d1"
    )  # 4-8 < 1-4
    assert policy.expected_blocks(d0, [1, 2, 5]) == 2

    not_in_sync = RoutingPolicy("kv", KVEventTracker())
    d1.remember_blocks([7, 8])  # the prefix policy's guess
    assert not_in_sync.pick([d0, d1], [7, 8]).address == "d1"
    assert not_in_sync.expected_blocks(d1, [7, 8]) == 2


def test_bench_routing_workload_is_seeded_and_its_verdict_needs_every_repeat():
    from pdserve.bench.routing import SharedPrefixWorkload, main, tenant_homes, verdict

    workload = SharedPrefixWorkload(
        tenants=3, users=2, system_len=32, user_len=8, question_len=4, requests=10, seed=1
    )
    prompts = workload.prompts()
    assert prompts == workload.prompts()  # every policy gets the same requests
    systems = {tenant: prompt[:32] for tenant, prompt in prompts}
    assert all(prompt[:32] == systems[tenant] and len(prompt) == 44 for tenant, prompt in prompts)

    def row(repeat: int, policy: str, hit: float, pulled: float) -> dict:
        return {"repeat": repeat, "policy": policy, "prefill_hit_rate": hit, "pulled_blocks_per_req": pulled}

    phased = SharedPrefixWorkload(tenants=6, users=2, system_len=32, user_len=8, question_len=4, requests=40,
                                  seed=1, phases=4, active_tenants=2)  # fmt: skip
    asked = [{tenant for tenant, _ in phased.prompts()[k * 10 : (k + 1) * 10]} for k in range(4)]
    assert all(len(tenants) <= 2 for tenants in asked) and len(set().union(*asked)) > 2  # traffic shifts
    assert tenant_homes([(0, "a"), (0, "a"), (0, "b"), (1, "b"), (2, "b"), (3, "a")]) == [2, 2]
    assert tenant_homes([(0, "a"), (1, "a"), (2, "a")]) == [3]
    for bad in (["--phases", "0"], ["--active-tenants", "9"], ["--phases", "5", "--requests", "4"]):
        assert main(bad) == 2  # refused before any engine starts

    rows = [row(0, "prefix", 0.5, 10), row(0, "kv", 0.6, 9), row(1, "prefix", 0.6, 9), row(1, "kv", 0.59, 8)]
    assert verdict(rows) == {
        "kv_beats_prefix_on_hit_rate_every_repeat": False,
        "kv_beats_prefix_on_blocks_pulled_every_repeat": True,
    }


def test_pending_blocks_leave_when_stored_dropped_or_expired():
    now = [100.0]
    pending = PendingBlocks(ttl=10.0, clock=lambda: now[0])
    pending.add("a", [1, 2, 3])
    assert all(pending.holds("a", h) for h in (1, 2, 3)) and not pending.holds("b", 1)
    pending.stored("a", [1, 2])  # its BlockStored arrived: the index holds them now
    assert not pending.holds("a", 1) and pending.holds("a", 3)
    now[0] += 10.0
    assert not pending.holds("a", 3) and "a" not in pending.expiry_of  # expired: its request never stored it
    pending.add("a", [4])
    pending.clear("a")  # the engine went down or restarted
    assert pending.num_blocks("a") == 0
    pending.add("b", [5])
    now[0] += 20.0
    pending.add("c", [6])  # entries no lookup reaches are purged too
    assert "b" not in pending.expiry_of


def test_routed_prompt_counts_as_held_until_its_blocks_are_stored_then_the_index_decides():
    port, replay_port = pick_free_ports("127.0.0.1", 2)
    publisher = KVEventPublisher("127.0.0.1", port, replay_port)

    async def scenario() -> None:
        tracker = KVEventTracker()
        publisher.publish(EventBatch(0.0, [AllBlocksCleared(), _stored(1)]))
        tracker.engine_up(ENGINE, "instance-1", port, replay_port)
        await _until(lambda: tracker.in_sync(ENGINE))
        tracker.routed(ENGINE, [1, 2, 3])  # 1 is held already: only 2 and 3 are pending
        assert tracker.pending.expiry_of[ENGINE].keys() == {2, 3}
        assert tracker.matched_blocks(ENGINE, [1, 2, 3, 4]) == 3
        publisher.publish(EventBatch(0.0, [_stored(2, 3)]))  # the engine scheduled it
        await _until(lambda: tracker.pending.num_blocks(ENGINE) == 0)
        publisher.publish(EventBatch(0.0, [BlockRemoved([2])]))  # evicted afterwards: exact again
        await _until(lambda: tracker.matched_blocks(ENGINE, [1, 2, 3]) == 1)
        tracker.routed(ENGINE, [7])
        tracker.engine_up(ENGINE, "instance-2", 0, 0)  # restarted: nothing of it is pending either
        assert tracker.matched_blocks(ENGINE, [7]) == 0
        tracker.close()

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def test_kv_policy_sends_a_second_same_prefix_request_where_the_first_went_before_any_event():
    tracker = _InSync()
    p0, p1 = _engine("prefill", "p0"), _engine("prefill", "p1")
    policy = RoutingPolicy("kv", tracker, load_weight=4.0)
    prompt = list(range(1, 9))  # 8 blocks nobody holds
    first = policy.pick([p0, p1], prompt)
    assert policy.expected_blocks(first, prompt) == 0
    policy.routed(first, prompt)
    first.in_flight += 1
    second = policy.pick([p0, p1], prompt)  # 8 - 4 x 1 > 0 - 0
    assert second is first and policy.expected_blocks(second, prompt) == 8
    RoutingPolicy("prefix", tracker).routed(p1, [42])
    assert tracker.pending.num_blocks("p1") == 0  # only kv counts what it routed
