"""The scheduler's remote-KV state machine, driven by a FakeConnector and hand-made worker reports.

Decode side: WAITING -> WAITING_FOR_REMOTE_KVS (blocks allocated, nothing scheduled) -> the load
lands (``finished_recving``) -> RUNNING with only the last prompt token recomputed; a failed load
(``invalid_block_ids``) is recomputed from the last valid block or fails the request.
Prefill side: a finished request's blocks are held (``delay_free``) until ``finished_sending``
or an abort. Every test ends with every block free (the ``make_scheduler`` fixture checks).
"""

from __future__ import annotations

import pytest

from pdserve.connector.base import KVConnectorMetadata
from pdserve.engine.request import RequestStatus
from tests.helpers.scheduler import (
    FakeConnector,
    Transcript,
    fresh_prompt,
    make_request,
    reference_output,
    run_step,
    run_until_idle,
    scheduler_factory_fixture,
)

REMOTE_PREFILL = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [7, 8, 9]}


@pytest.fixture
def make_scheduler(request):
    yield from scheduler_factory_fixture(request)


def _remote_request(req_id: str, prompt, max_tokens: int = 3):
    return make_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=dict(REMOTE_PREFILL))


def _start_remote_load(scheduler, request):
    """Add a decode-side request and take it to WAITING_FOR_REMOTE_KVS; returns its block ids."""
    scheduler.add_request(request)
    step = run_step(scheduler)
    assert request.request_id not in step.scheduled
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return scheduler.kv_cache_manager.get_block_ids(request.request_id)


# ------------------------------------------------------------------------------ decode side


def test_decode_request_waits_for_remote_kvs_with_blocks_allocated_and_nothing_scheduled(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, num_blocks=16, log_stats=True)
    request = _remote_request("r", 10)
    scheduler.add_request(request)

    step = run_step(scheduler)
    assert step.scheduled == {}
    assert step.scheduler_output.total_num_scheduled_tokens == 0
    assert step.scheduler_output.scheduled_new_reqs == []
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0
    block_ids = scheduler.kv_cache_manager.get_block_ids("r")
    assert len(block_ids) == 3  # room for the whole 10-token prompt
    assert scheduler.kv_cache_manager.usage == pytest.approx(3 / 16)
    assert connector.matched_calls == [("r", 0)]
    assert connector.alloc_calls == [("r", block_ids, 10)]
    assert scheduler.get_request_counts() == (0, 1)
    assert scheduler.has_unfinished_requests()
    assert scheduler.make_stats().num_waiting_for_remote_kvs == 1

    # Until the worker reports the load, the request stays put and nothing is computed for it.
    for _ in range(3):
        step = run_step(scheduler)
        assert step.scheduled == {}
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.kv_cache_manager.get_block_ids("r") == block_ids
    assert len(connector.alloc_calls) == 1  # blocks were allocated once

    run_step(scheduler, finished_recving={"r"})
    run_until_idle(scheduler)


def test_landed_remote_kvs_run_the_request_recomputing_only_the_last_prompt_token(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    request = _remote_request("r", 10, max_tokens=3)
    block_ids = _start_remote_load(scheduler, request)

    step = run_step(scheduler, finished_recving={"r"})
    assert step.scheduled == {}  # reported in this step's output; picked up by the next schedule()

    step = run_step(scheduler)
    assert request.status == RequestStatus.RUNNING
    assert step.scheduled == {"r": 1}
    (new,) = step.scheduler_output.scheduled_new_reqs
    assert new.num_computed_tokens == 9  # prompt_len - 1: the last token's logits are needed
    assert new.block_ids == block_ids
    assert request.num_cached_tokens == 9
    assert step.output_of("r").new_token_ids == reference_output(request)[:1]

    transcript = run_until_idle(scheduler)
    assert request.output_token_ids == reference_output(request)
    assert transcript.finish_reasons == {"r": "length"}


def _running_with_a_landed_load(make_scheduler, handover_step: str):
    """Two local requests decoding, and a remote one whose load has just been reported."""
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, handover_step=handover_step)
    local = [make_request(f"local-{i}", 6, max_tokens=20) for i in range(2)]
    for request in local:
        scheduler.add_request(request)
    run_step(scheduler)  # their prefills
    remote = _remote_request("remote", 10, max_tokens=8)
    _start_remote_load(scheduler, remote)
    run_step(scheduler, finished_recving={"remote"})
    return scheduler, local, remote


def test_joined_handover_runs_a_landed_request_in_the_next_batch_step(make_scheduler):
    scheduler, local, remote = _running_with_a_landed_load(make_scheduler, "joined")
    step = run_step(scheduler)
    assert step.scheduled == {"local-0": 1, "local-1": 1, "remote": 1}  # vLLM's behaviour
    transcript = run_until_idle(scheduler)
    assert transcript.finish_reasons == {"remote": "length", "local-0": "length", "local-1": "length"}


def test_separate_handover_step_runs_landed_requests_alone_then_everyone(make_scheduler):
    scheduler, local, remote = _running_with_a_landed_load(make_scheduler, "separate")
    step = run_step(scheduler)
    assert step.scheduled == {"remote": 1}  # the running requests wait this small step
    assert step.scheduler_output.scheduled_cached_reqs.req_ids == []
    assert step.output_of("remote").new_token_ids == reference_output(remote)[:1]
    step = run_step(scheduler)
    assert step.scheduled == {"local-0": 1, "local-1": 1, "remote": 1}
    run_until_idle(scheduler)
    for request in [*local, remote]:  # nobody's tokens changed, only when they were computed
        assert request.output_token_ids == reference_output(request)


def test_separate_handover_steps_take_at_most_one_step_in_four_from_the_running(make_scheduler):
    scheduler, local, remote = _running_with_a_landed_load(make_scheduler, "separate")
    assert run_step(scheduler).scheduled == {"remote": 1}
    # Another load lands right away: it joins the batch until HANDOVER_STEP_MIN_GAP has passed.
    later = _remote_request("later", 10, max_tokens=3)
    _start_remote_load(scheduler, later)  # this step also runs the batch
    step = run_step(scheduler, finished_recving={"later"})
    assert set(step.scheduled) == {"local-0", "local-1", "remote"}
    step = run_step(scheduler)
    assert step.scheduled == {"local-0": 1, "local-1": 1, "remote": 1, "later": 1}
    run_until_idle(scheduler)
    assert later.output_token_ids == reference_output(later)


def test_a_separate_handover_step_that_could_not_run_does_not_count_as_one(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, handover_step="separate", max_num_seqs=2)
    steady = make_request("steady", 6, max_tokens=20)
    scheduler.add_request(steady)
    run_step(scheduler)
    remote = _remote_request("remote", 10, max_tokens=4)
    _start_remote_load(scheduler, remote)  # waiting for its KV: it holds no seat
    brief = make_request("brief", 6, max_tokens=2)
    scheduler.add_request(brief)
    run_step(scheduler, finished_recving={"remote"})  # "brief" takes the second seat
    # Landed, but both seats are taken: an ordinary step instead of the separate one.
    step = run_step(scheduler)
    assert step.scheduled == {"steady": 1, "brief": 1}
    assert step.output_of("brief").finish_reason == "length"
    # A seat is free: the separate step runs now, not HANDOVER_STEP_MIN_GAP steps later.
    assert run_step(scheduler).scheduled == {"remote": 1}
    run_until_idle(scheduler)
    assert remote.output_token_ids == reference_output(remote)


def test_separate_handover_step_is_not_taken_when_nothing_else_runs(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, handover_step="separate")
    remote = _remote_request("remote", 10, max_tokens=3)
    _start_remote_load(scheduler, remote)
    run_step(scheduler, finished_recving={"remote"})
    waiting = make_request("prompt", 6, max_tokens=2)
    scheduler.add_request(waiting)
    step = run_step(scheduler)  # an ordinary step: the landed request and the new prompt
    assert step.scheduled == {"remote": 1, "prompt": 6}
    run_until_idle(scheduler)


def test_partial_local_prefix_hit_reduces_what_the_connector_loads(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    shared = fresh_prompt(8)
    scheduler.add_request(make_request("local", shared + fresh_prompt(2), max_tokens=1))
    run_until_idle(scheduler)
    cached = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert cached

    request = _remote_request("r", shared + fresh_prompt(4), max_tokens=2)
    block_ids = _start_remote_load(scheduler, request)
    # The connector is told about the 8 locally cached tokens and loads only the other 4.
    assert connector.matched_calls[-1] == ("r", 8)
    assert connector.alloc_calls[-1] == ("r", block_ids, 4)
    assert len(block_ids) == 3

    run_step(scheduler, finished_recving={"r"})
    step = run_step(scheduler)
    assert step.scheduled == {"r": 1}
    assert step.scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 11
    run_until_idle(scheduler)
    assert request.output_token_ids == reference_output(request)


def test_blocks_being_loaded_are_not_prefix_cache_hits_until_they_land(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    prompt = fresh_prompt(9)
    _start_remote_load(scheduler, _remote_request("loading", prompt, max_tokens=1))

    # Same prompt, computed locally: the loading request's blocks hold no KV yet.
    scheduler.add_request(make_request("local", prompt, max_tokens=1))
    assert run_step(scheduler).scheduled == {"local": 9}
    run_step(scheduler, finished_recving={"loading"})
    run_until_idle(scheduler)
    assert scheduler.requests == {}


def test_a_request_waiting_for_remote_kvs_does_not_block_later_requests(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    _start_remote_load(scheduler, _remote_request("remote", 10))
    scheduler.add_request(make_request("local", 6, max_tokens=2))
    step = run_step(scheduler)
    assert step.scheduled == {"local": 6}
    assert scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run_step(scheduler, finished_recving={"remote"})
    run_until_idle(scheduler)


def test_finished_recving_for_an_unknown_request_is_ignored(make_scheduler):
    scheduler = make_scheduler(connector=FakeConnector())
    scheduler.add_request(make_request("r", 5, max_tokens=2))
    run_step(scheduler, finished_recving={"nobody"}, finished_sending={"nobody-either"})
    run_until_idle(scheduler)


def test_connector_metadata_is_built_every_step_and_attached_to_the_output(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request("r", 5, max_tokens=2))
    step = run_step(scheduler)
    assert isinstance(step.scheduler_output.kv_connector_metadata, KVConnectorMetadata)
    run_step(scheduler)
    assert connector.num_metadata_built == 2
    # A local request is offered to the connector once, with its local hit, and loads nothing.
    assert connector.matched_calls == [("r", 0)]
    assert connector.alloc_calls[0][2] == 0


# ------------------------------------------------------------------------------ failed loads


def test_invalid_blocks_with_recompute_policy_recompute_from_the_last_valid_block(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_load_failure_policy="recompute")
    request = _remote_request("r", 12, max_tokens=3)
    block_ids = _start_remote_load(scheduler, request)
    assert len(block_ids) == 3

    step = run_step(scheduler, finished_recving={"r"}, invalid_block_ids={block_ids[1]})
    assert step.output_of("r") is None  # not an error: it will be recomputed

    step = run_step(scheduler)
    assert request.status == RequestStatus.RUNNING
    (new,) = step.scheduler_output.scheduled_new_reqs
    assert new.num_computed_tokens == 4  # block 0 is valid, block 1 (tokens 4..7) is not
    assert step.scheduled == {"r": 8}
    assert new.block_ids == block_ids
    transcript = Transcript()
    transcript.record(step)
    run_until_idle(scheduler, transcript=transcript)
    assert request.output_token_ids == reference_output(request)
    assert transcript.finish_reasons == {"r": "length"}


def test_invalid_first_block_recomputes_the_whole_prompt(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_load_failure_policy="recompute")
    request = _remote_request("r", 12, max_tokens=2)
    block_ids = _start_remote_load(scheduler, request)
    run_step(scheduler, finished_recving={"r"}, invalid_block_ids={block_ids[0], block_ids[2]})
    step = run_step(scheduler)
    assert step.scheduled == {"r": 12}
    assert scheduler.kv_cache_manager.get_block_ids("r") == block_ids
    run_until_idle(scheduler)
    assert request.output_token_ids == reference_output(request)


def test_recompute_from_zero_after_a_failed_load_keeps_a_consistent_block_table(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_load_failure_policy="recompute")
    prompt = fresh_prompt(12)
    request = _remote_request("r", prompt, max_tokens=2)
    _start_remote_load(scheduler, request)
    # Meanwhile the same prompt is computed locally, so its prefix is in the local cache.
    scheduler.add_request(make_request("local", prompt, max_tokens=1))
    run_step(scheduler)
    block_ids = scheduler.kv_cache_manager.get_block_ids("r")
    run_step(scheduler, finished_recving={"r"}, invalid_block_ids={block_ids[0]})

    step = run_step(scheduler)
    (new,) = step.scheduler_output.scheduled_new_reqs
    table = scheduler.kv_cache_manager.req_to_blocks["r"]
    # One block per 4 tokens, and every block before num_computed_tokens holds r's own prefix.
    assert len(new.block_ids) == len(table) == 3
    num_valid_blocks = new.num_computed_tokens // 4
    assert [b.block_hash for b in table[:num_valid_blocks]] == request.block_hashes[:num_valid_blocks]
    run_until_idle(scheduler)


def test_invalid_blocks_of_another_request_leave_a_load_alone(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_load_failure_policy="fail")
    good = _remote_request("good", 8, max_tokens=1)
    bad = _remote_request("bad", 8, max_tokens=1)
    good_blocks = _start_remote_load(scheduler, good)
    bad_blocks = _start_remote_load(scheduler, bad)
    assert not set(good_blocks) & set(bad_blocks)
    step = run_step(scheduler, finished_recving={"good", "bad"}, invalid_block_ids={bad_blocks[1]})
    assert step.output_of("bad").finish_reason == "error"
    assert good.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert run_step(scheduler).scheduled == {"good": 1}
    run_until_idle(scheduler)


def test_invalid_blocks_with_fail_policy_finish_the_request_with_error_and_free_its_blocks(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_load_failure_policy="fail")
    request = _remote_request("r", 12, max_tokens=3)
    block_ids = _start_remote_load(scheduler, request)
    assert scheduler.kv_cache_manager.usage > 0

    step = run_step(scheduler, finished_recving={"r"}, invalid_block_ids={block_ids[2]})
    output = step.output_of("r")
    assert output is not None
    assert output.finish_reason == "error"
    assert output.new_token_ids == []
    assert request.status == RequestStatus.FINISHED_ERROR
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.get_request_counts() == (0, 0)
    assert connector.finished_calls[-1][0] == "r"
    assert scheduler.has_finished_requests()
    assert "r" in scheduler.schedule().finished_req_ids


def test_failed_load_error_goes_to_the_requests_own_client(make_scheduler):
    scheduler = make_scheduler(connector=FakeConnector(), kv_load_failure_policy="fail")
    request = _remote_request("r", 8, max_tokens=2)
    request.client_index = 1
    block_ids = _start_remote_load(scheduler, request)
    step = run_step(scheduler, finished_recving={"r"}, invalid_block_ids={block_ids[0]})
    assert [o.request_id for o in step.outputs(1)] == ["r"]
    assert step.outputs(0) == []


# ------------------------------------------------------------------------------ aborts on the decode side


def test_abort_during_remote_load_without_delay_free_frees_blocks_at_once(make_scheduler):
    connector = FakeConnector(delay_free_aborted_loads=False)
    scheduler = make_scheduler(connector=connector)
    request = _remote_request("r", 10)
    _start_remote_load(scheduler, request)
    scheduler.finish_requests("r")
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.get_request_counts() == (0, 0)
    assert "r" in run_step(scheduler).scheduler_output.finished_req_ids
    run_step(scheduler, finished_recving={"r"})  # a late report is ignored
    assert scheduler.kv_cache_manager.usage == 0.0


def test_abort_during_remote_load_with_delay_free_keeps_blocks_until_the_load_lands(make_scheduler):
    connector = FakeConnector(delay_free_aborted_loads=True)
    scheduler = make_scheduler(connector=connector, log_stats=True)
    request = _remote_request("r", 10)
    block_ids = _start_remote_load(scheduler, request)

    scheduler.finish_requests(["r"])
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.get_request_counts() == (0, 0)
    assert not scheduler.has_unfinished_requests()
    # The worker may still be writing into the blocks: they must not be reused yet.
    assert scheduler.kv_cache_manager.get_block_ids("r") == block_ids
    assert scheduler.kv_cache_manager.usage > 0
    assert scheduler.make_stats().num_held_blocks == 3
    for _ in range(2):
        step = run_step(scheduler)
        assert step.scheduled == {}
        assert scheduler.kv_cache_manager.usage > 0

    run_step(scheduler, finished_recving={"r"})
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.make_stats().num_held_blocks == 0
    assert request.status == RequestStatus.FINISHED_ABORTED


def test_abort_after_the_load_landed_but_before_scheduling_still_frees_blocks(make_scheduler):
    connector = FakeConnector(delay_free_aborted_loads=True)
    scheduler = make_scheduler(connector=connector)
    request = _remote_request("r", 10)
    _start_remote_load(scheduler, request)
    run_step(scheduler, finished_recving={"r"})  # the load is done; the request is still waiting
    scheduler.finish_requests("r")  # client cancels before the next schedule()
    for _ in range(3):
        run_step(scheduler)
    # No finished_recving will ever come again: the blocks must not stay held.
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.requests == {}


# ------------------------------------------------------------------------------ prefill (producer) side


def _producer_request(req_id: str, prompt=10):
    return make_request(req_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})


def test_producer_holds_finished_request_blocks_until_finished_sending(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, num_blocks=16, log_stats=True)
    request = _producer_request("p")
    scheduler.add_request(request)

    step = run_step(scheduler)
    output = step.output_of("p")
    block_ids = connector.finished_calls[-1][1]
    assert len(block_ids) == 3
    # The finished request's output carries what the decode engine needs.
    assert output.finish_reason == "length"
    assert output.new_token_ids == reference_output(request)[:1]
    assert output.kv_transfer_params["do_remote_prefill"] is True
    assert output.kv_transfer_params["remote_block_ids"] == block_ids
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # Finished, but its blocks stay allocated for the remote reader.
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_request_counts() == (0, 0)
    assert scheduler.kv_cache_manager.usage == pytest.approx(3 / 16)
    assert scheduler.kv_cache_manager.get_block_ids("p") == block_ids
    assert scheduler.make_stats().num_held_blocks == 3
    assert scheduler.reset_prefix_cache() is False
    assert "p" in run_step(scheduler).scheduler_output.finished_req_ids
    assert scheduler.kv_cache_manager.usage > 0

    run_step(scheduler, finished_sending={"p"})
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.make_stats().num_held_blocks == 0
    assert scheduler.reset_prefix_cache() is True
    run_step(scheduler, finished_sending={"p"})  # a duplicate report is harmless


def test_held_blocks_stay_in_the_prefix_cache_after_release(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    prompt = fresh_prompt(10)
    scheduler.add_request(_producer_request("p", prompt))
    run_step(scheduler)
    run_step(scheduler, finished_sending={"p"})
    again = _producer_request("again", prompt)
    scheduler.add_request(again)
    assert run_step(scheduler).scheduled == {"again": 2}
    run_step(scheduler, finished_sending={"again"})


def test_abort_of_a_held_request_frees_its_blocks_and_releases_the_lease(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(_producer_request("p"))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.usage > 0

    scheduler.finish_requests("p")
    assert scheduler.kv_cache_manager.usage == 0.0
    assert connector.released == ["p"]
    assert scheduler.requests == {}
    run_step(scheduler, finished_sending={"p"})  # the reader's late notice is ignored
    scheduler.finish_requests("p")  # and a second abort is a no-op
    assert connector.released == ["p"]


def test_abort_while_prefilling_on_the_producer_frees_blocks_at_once(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, max_num_batched_tokens=8)
    scheduler.add_request(_producer_request("p", 20))
    run_step(scheduler)  # first chunk only
    scheduler.finish_requests("p")
    assert connector.finished_calls[-1][2] == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.usage == 0.0


def test_prefill_then_decode_engines_produce_the_colocated_output(make_scheduler):
    """The whole P/D dance with two schedulers and the fake connector on each side."""
    producer_connector, consumer_connector = FakeConnector(), FakeConnector()
    producer = make_scheduler(connector=producer_connector)
    consumer = make_scheduler(connector=consumer_connector)
    prompt = fresh_prompt(13)
    expected = reference_output(make_request("colocated", prompt, max_tokens=5))

    producer.add_request(
        make_request("req", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    prefill_output = run_step(producer).output_of("req")
    assert prefill_output.new_token_ids == expected[:1]
    params = prefill_output.kv_transfer_params

    decode_request = make_request("req", prompt, max_tokens=5, kv_transfer_params=params)
    consumer.add_request(decode_request)
    run_step(consumer)
    assert decode_request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run_step(consumer, finished_recving={"req"})
    run_step(producer, finished_sending={"req"})  # decode read the blocks: prefill frees them
    assert producer.kv_cache_manager.usage == 0.0
    transcript = run_until_idle(consumer)
    assert transcript.tokens["req"] == expected
