"""Scheduler behaviours checked against vLLM's own unit tests (kv_load_failure_recovery,
invalid_blocks_correctness, error_propagation, and the prefix-cache stats of test_scheduler).

A synchronous-load connector (like vLLM's mock connector with ``load_async=False``) hands the
scheduler external tokens that count as computed at once; the test then plays the worker and
reports some of those blocks invalid in the same step's ``ModelRunnerOutput``.
"""

from __future__ import annotations

import logging

import pytest

from pdserve.engine.request import Request, RequestStatus
from tests.helpers.scheduler import (
    FakeConnector,
    Transcript,
    make_request,
    model_runner_output_for,
    reference_output,
    run_step,
    run_until_idle,
    scheduler_factory_fixture,
)

POISON = 999  # what a step computed over corrupted KV samples


@pytest.fixture
def make_scheduler(request):
    yield from scheduler_factory_fixture(request)


class SyncLoadConnector(FakeConnector):
    """Loads every uncached prompt token but the last from a "remote" engine, synchronously:
    ``get_num_new_matched_tokens`` answers ``(n, False)``, so the request runs in the same step."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.matched_calls.append((request.request_id, num_computed_tokens))
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and request.request_id not in self.loads_started:
            return max(0, request.num_tokens - 1 - num_computed_tokens), False
        return 0, False


class EmptyAsyncLoadConnector(FakeConnector):
    """Breaks the contract: "load asynchronously" with nothing to load."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, True


def _remote(prompt: list[int], request_id: str, max_tokens: int = 4) -> Request:
    return make_request(request_id, prompt, max_tokens, kv_transfer_params={"do_remote_prefill": True})


def _poisoned(request: Request) -> int:
    return POISON


def _cached_tokens_for(scheduler, prompt: list[int]) -> int:
    """How many tokens of ``prompt`` a new request would find in the prefix cache right now."""
    probe = make_request("probe", prompt)
    _, num_tokens = scheduler.kv_cache_manager.get_computed_blocks(probe)
    return num_tokens


def test_invalid_block_of_a_sync_loaded_running_request_is_recomputed(make_scheduler):
    scheduler = make_scheduler(connector=SyncLoadConnector())
    prompt = list(range(100, 112))  # 3 blocks of 4; 11 tokens loaded, the last computed here
    request = _remote(prompt, "sync")
    scheduler.add_request(request)

    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"sync": 1} and request.num_computed_tokens == 12
    block_ids = scheduler.kv_cache_manager.get_block_ids("sync")
    runner_output = model_runner_output_for(scheduler, first, _poisoned, invalid_block_ids=[block_ids[1]])
    outputs = scheduler.update_from_output(first, runner_output)

    # The token sampled over bad KV is dropped; progress rolls back to the first invalid block.
    assert all(o.new_token_ids == [] for group in outputs.values() for o in group.outputs)
    assert request.output_token_ids == []
    assert request.num_computed_tokens == 4
    assert request.status == RequestStatus.RUNNING
    # No later request can hit the invalid block (or what was computed after it).
    assert _cached_tokens_for(scheduler, prompt) == 4

    recompute = run_step(scheduler)
    assert recompute.scheduled == {"sync": 8}
    # The runner rebuilds its copy (without the dropped token) from a full new-request record.
    assert [r.req_id for r in recompute.scheduler_output.scheduled_new_reqs] == ["sync"]
    transcript = Transcript()
    transcript.record(recompute)
    run_until_idle(scheduler, transcript=transcript)
    assert transcript.tokens["sync"] == reference_output(request) and POISON not in transcript.tokens["sync"]
    assert transcript.finish_reasons["sync"] == "length"


def test_requests_sharing_an_invalid_block_roll_back_too(make_scheduler):
    scheduler = make_scheduler(connector=SyncLoadConnector())
    prompt = list(range(200, 212))
    loaded = _remote(prompt, "loaded")
    sharer = make_request("sharer", prompt + [7, 8, 9, 10, 11])  # hits the loaded request's blocks
    scheduler.add_request(loaded)
    scheduler.add_request(sharer)
    step = scheduler.schedule()
    shared = scheduler.kv_cache_manager.get_block_ids("loaded")
    assert scheduler.kv_cache_manager.get_block_ids("sharer")[:2] == shared[:2]
    runner_output = model_runner_output_for(scheduler, step, _poisoned, invalid_block_ids=[shared[1]])
    scheduler.update_from_output(step, runner_output)
    assert loaded.output_token_ids == [] and sharer.output_token_ids == []
    assert loaded.num_computed_tokens == 4 and sharer.num_computed_tokens == 4

    transcript = run_until_idle(scheduler)
    assert transcript.tokens["loaded"] == reference_output(loaded)
    assert transcript.tokens["sharer"] == reference_output(sharer)


def test_invalid_sync_loaded_block_under_fail_policy_errors_the_request_and_leaves_the_cache(make_scheduler):
    scheduler = make_scheduler(connector=SyncLoadConnector(), kv_load_failure_policy="fail")
    prompt = list(range(300, 312))
    request = _remote(prompt, "doomed")
    scheduler.add_request(request)
    step = scheduler.schedule()
    block_ids = scheduler.kv_cache_manager.get_block_ids("doomed")
    runner_output = model_runner_output_for(scheduler, step, _poisoned, invalid_block_ids=[block_ids[1]])
    outputs = scheduler.update_from_output(step, runner_output)
    (output,) = [o for group in outputs.values() for o in group.outputs]
    assert output.request_id == "doomed" and output.new_token_ids == []
    assert output.finish_reason == "error" and output.stop_reason == "kv_load_failed"
    assert request.status == RequestStatus.FINISHED_ERROR
    assert "doomed" not in scheduler.requests

    # The same prompt again: only the block before the invalid one may come from the cache.
    again = make_request("again", prompt)
    scheduler.add_request(again)
    transcript = run_until_idle(scheduler)
    assert again.num_cached_tokens == 4
    assert transcript.tokens["again"] == reference_output(again)


def test_prefix_cache_counters_count_a_request_once_when_it_is_admitted(make_scheduler):
    scheduler = make_scheduler(num_blocks=6, max_model_len=32, log_stats=True)
    big = make_request("big", 16, max_tokens=4)  # 4 blocks, then a 5th while decoding
    scheduler.add_request(big)
    run_step(scheduler)
    waiting = make_request("waiting", 12, max_tokens=2)  # needs 3 blocks: not before "big" ends
    scheduler.add_request(waiting)
    steps_waiting = 0
    while waiting.status == RequestStatus.WAITING:
        run_step(scheduler)
        steps_waiting += 1
    assert steps_waiting > 1, "the test needs the request to wait for blocks over several steps"
    run_until_idle(scheduler)
    stats = scheduler.make_stats()
    assert stats.prefix_cache_queries == 16 + 12


def test_a_connector_announcing_an_empty_async_load_does_not_park_the_request(make_scheduler, caplog):
    scheduler = make_scheduler(connector=EmptyAsyncLoadConnector())
    request = make_request("r", 10, max_tokens=3)
    scheduler.add_request(request)
    with caplog.at_level(logging.WARNING):
        transcript = run_until_idle(scheduler, max_steps=20)
    assert transcript.tokens["r"] == reference_output(request)
    assert any("EmptyAsyncLoadConnector" in record.getMessage() for record in caplog.records)
