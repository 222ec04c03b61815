"""Scheduler behaviour (vLLM v1's algorithm) with a fake model step; no connector.

Every test's schedulers must end idle with every KV block free (checked by ``make_scheduler``),
and every step is checked against the token budget and ``max_num_seqs`` by ``run_step``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.interface import SchedulerInterface
from pdserve.engine.request import RequestStatus
from tests.helpers.scheduler import (
    EOS,
    FakeConnector,
    SchedulerFactory,
    Transcript,
    assert_idle_and_no_leak,
    fresh_prompt,
    make_request,
    model_runner_output_for,
    next_token,
    reference_output,
    run_step,
    run_until_idle,
    scheduler_factory_fixture,
)


@pytest.fixture
def make_scheduler(request):
    yield from scheduler_factory_fixture(request)


def _first_scheduled_order(transcript: Transcript) -> list[str]:
    order: list[str] = []
    for step in transcript.steps:
        for new in step.scheduler_output.scheduled_new_reqs:
            if new.req_id not in order:
                order.append(new.req_id)
    return order


# ------------------------------------------------------------------------------ basics


def test_scheduler_implements_the_interface(make_scheduler):
    scheduler = make_scheduler()
    assert isinstance(scheduler, SchedulerInterface)
    assert scheduler.get_kv_connector() is None
    scheduler.shutdown()


def test_new_request_is_prefilled_whole_then_decoded_one_token_per_step(make_scheduler):
    scheduler = make_scheduler()
    request = make_request("r", 10, max_tokens=3)
    scheduler.add_request(request)
    assert request.status == RequestStatus.WAITING
    assert scheduler.get_request_counts() == (0, 1)

    step = run_step(scheduler)
    out = step.scheduler_output
    assert out.num_scheduled_tokens == {"r": 10}
    assert out.total_num_scheduled_tokens == 10
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, len(new.block_ids)) == ("r", 0, 3)
    assert new.prompt_token_ids == request.prompt_token_ids
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 10
    assert scheduler.get_request_counts() == (1, 0)
    assert step.output_of("r").new_token_ids == reference_output(request)[:1]

    step = run_step(scheduler)
    assert step.scheduled == {"r": 1}
    assert step.scheduler_output.scheduled_new_reqs == []
    assert step.scheduler_output.scheduled_cached_reqs.req_ids == ["r"]
    assert step.scheduler_output.scheduled_cached_reqs.num_computed_tokens == [10]

    transcript = run_until_idle(scheduler)
    assert request.output_token_ids == reference_output(request)
    assert transcript.finish_reasons == {"r": "length"}
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_update_from_output_groups_outputs_by_client_index(make_scheduler):
    scheduler = make_scheduler()
    first, second = make_request("first", 5, max_tokens=1), make_request("second", 5, max_tokens=1)
    second.client_index = 1
    scheduler.add_request(first)
    scheduler.add_request(second)
    step = run_step(scheduler)
    assert [o.request_id for o in step.outputs(0)] == ["first"]
    assert [o.request_id for o in step.outputs(1)] == ["second"]


def test_duplicate_request_id_is_rejected(make_scheduler):
    scheduler = make_scheduler()
    original = make_request("r", 6, max_tokens=2)
    scheduler.add_request(original)
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add_request(make_request("r", 6, max_tokens=2))
    assert scheduler.requests["r"] is original
    run_step(scheduler)
    with pytest.raises(ValueError, match="request_id"):  # also while it is running
        scheduler.add_request(make_request("r", 6, max_tokens=2))
    assert scheduler.get_request_counts() == (1, 0)
    run_until_idle(scheduler)
    assert original.output_token_ids == reference_output(original)
    # A finished id may be used again.
    scheduler.add_request(make_request("r", 6, max_tokens=1))
    run_until_idle(scheduler)


# ------------------------------------------------------------------------------ budget and order


def test_token_budget_is_filled_but_never_exceeded(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 7, max_tokens=3))
    totals = []
    while scheduler.has_unfinished_requests():
        step = run_step(scheduler)  # asserts total <= 10 and total == sum per request
        totals.append(step.scheduler_output.total_num_scheduled_tokens)
    assert max(totals) == 10
    # Prefill work (28 tokens) is packed into full steps before decodes thin out.
    assert totals[:2] == [10, 10]
    assert sum(totals) == 4 * 7 + 4 * 2  # each prompt once, then 2 decode tokens each


def test_running_requests_are_scheduled_before_waiting_ones(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 4, max_tokens=5))
    assert run_step(scheduler).scheduled == {"a": 4}
    scheduler.add_request(make_request("b", 20, max_tokens=2))
    step = run_step(scheduler)
    # a's decode token first, the rest of the budget to b's first chunk.
    assert step.scheduled == {"a": 1, "b": 7}
    assert list(step.scheduled) == ["a", "b"]
    assert step.scheduler_output.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in step.scheduler_output.scheduled_new_reqs] == ["b"]
    run_until_idle(scheduler)


def test_waiting_requests_get_nothing_while_running_ones_use_the_whole_budget(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    assert run_step(scheduler).scheduled == {"a": 4}
    scheduler.add_request(make_request("b", 3, max_tokens=2))
    assert run_step(scheduler).scheduled == {"a": 4}
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    assert run_step(scheduler).scheduled == {"a": 2, "b": 2}
    run_until_idle(scheduler)


def test_chunked_prefill_splits_a_long_prompt_and_advances_computed_tokens(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("r", 20, max_tokens=2)
    scheduler.add_request(request)
    computed, outputs = [], []
    for _ in range(3):
        step = run_step(scheduler)
        computed.append((step.scheduled["r"], request.num_computed_tokens))
        outputs.append(step.output_of("r"))
    assert computed == [(8, 8), (8, 16), (4, 20)]
    # Only the last chunk yields a token.
    assert outputs[0] is None and outputs[1] is None
    assert outputs[2].new_token_ids == reference_output(request)[:1]
    run_until_idle(scheduler)
    assert request.output_token_ids == reference_output(request)


def test_chunks_after_the_first_continue_from_the_computed_tokens(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("r", 20, max_tokens=1))
    first = run_step(scheduler).scheduler_output
    assert first.scheduled_new_reqs[0].num_computed_tokens == 0
    second = run_step(scheduler).scheduler_output
    assert second.scheduled_new_reqs == []
    assert second.scheduled_cached_reqs.req_ids == ["r"]
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]
    run_until_idle(scheduler)


def test_without_chunked_prefill_a_prompt_bigger_than_the_remaining_budget_waits(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    scheduler.add_request(make_request("b", 10, max_tokens=2))
    step = run_step(scheduler)
    assert step.scheduled == {"a": 10}  # b does not fit in the 6 tokens left and is not split
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    assert scheduler.requests["b"].num_computed_tokens == 0
    assert run_step(scheduler).scheduled == {"a": 1, "b": 10}
    run_until_idle(scheduler)


def test_without_chunked_prefill_a_smaller_prompt_may_use_the_leftover_budget(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 10, max_tokens=2))
    scheduler.add_request(make_request("big", 10, max_tokens=2))
    scheduler.add_request(make_request("small", 5, max_tokens=2))
    assert run_step(scheduler).scheduled == {"a": 10, "small": 5}
    run_until_idle(scheduler)


def test_fcfs_prompts_too_big_for_the_budget_keep_their_arrival_order(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    scheduler.add_request(make_request("x", 20, max_tokens=8))
    scheduler.add_request(make_request("a", 16, max_tokens=2))
    scheduler.add_request(make_request("b", 16, max_tokens=2))
    assert run_step(scheduler).scheduled == {"x": 20}  # neither a nor b fits in the 12 left
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]
    # Next step 31 tokens are left: room for one of them, and a arrived first.
    assert run_step(scheduler).scheduled == {"x": 1, "a": 16}
    run_until_idle(scheduler)


def test_long_prefill_token_threshold_caps_each_chunk(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    scheduler.add_request(make_request("long", 10, max_tokens=2))
    scheduler.add_request(make_request("short", 3, max_tokens=3))
    assert run_step(scheduler).scheduled == {"long": 4, "short": 3}
    assert run_step(scheduler).scheduled == {"long": 4, "short": 1}
    assert run_step(scheduler).scheduled == {"long": 2, "short": 1}
    run_until_idle(scheduler)


def test_max_num_seqs_caps_running_requests(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 5, max_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    step = run_step(scheduler)
    assert step.scheduled == {"r0": 5, "r1": 5}
    assert scheduler.get_request_counts() == (2, 3)
    transcript = run_until_idle(scheduler)  # run_step checks len(running) <= 2 every step
    assert _first_scheduled_order(transcript) == ["r2", "r3", "r4"]
    for request in requests:
        assert request.output_token_ids == reference_output(request)


def test_fcfs_admits_requests_in_arrival_order_regardless_of_priority(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 4, max_tokens=1, priority=9))
    scheduler.add_request(make_request("b", 4, max_tokens=1, priority=0))
    scheduler.add_request(make_request("c", 4, max_tokens=1, priority=-5))
    transcript = run_until_idle(scheduler)
    assert _first_scheduled_order(transcript) == ["a", "b", "c"]


def test_priority_policy_admits_lower_value_first_then_earlier_arrival(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("a", 4, max_tokens=1, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("b", 4, max_tokens=1, priority=0, arrival_time=3.0))
    scheduler.add_request(make_request("c", 4, max_tokens=1, priority=0, arrival_time=2.0))
    scheduler.add_request(make_request("d", 4, max_tokens=1, priority=5, arrival_time=0.5))
    transcript = run_until_idle(scheduler)
    assert _first_scheduled_order(transcript) == ["c", "b", "d", "a"]


# ------------------------------------------------------------------------------ preemption


def test_running_out_of_blocks_preempts_the_latest_request_by_recompute(make_scheduler):
    # 4 blocks of 4 tokens; two 7-token prompts take 2 blocks each and both grow past 8 tokens.
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6)
    c = make_request("c", 7, max_tokens=2)  # arrives last and finds no room
    for request in (a, b, c):
        scheduler.add_request(request)
    transcript = Transcript()
    transcript.record(run_step(scheduler))
    transcript.record(run_step(scheduler))
    assert scheduler.kv_cache_manager.usage == 1.0
    assert list(scheduler.waiting) == [c]

    step = transcript.record(run_step(scheduler))  # a needs a 3rd block: b (last in) is the victim
    assert step.scheduled == {"a": 1}
    assert step.scheduler_output.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == reference_output(b)[:2]  # what it generated is kept
    assert scheduler.kv_cache_manager.num_blocks_of("b") == 0
    assert scheduler.get_request_counts() == (1, 2)
    assert list(scheduler.waiting) == [b, c]  # the victim goes back to the front of the line

    run_until_idle(scheduler, transcript=transcript)
    resumed = [new for s in transcript.steps[3:] for new in s.scheduler_output.scheduled_new_reqs]
    assert [new.req_id for new in resumed] == ["b", "c"]
    assert resumed[0].output_token_ids == reference_output(b)[:2]
    # Outputs continue exactly where they stopped: same tokens as without preemption.
    assert transcript.tokens == {"a": reference_output(a), "b": reference_output(b), "c": reference_output(c)}
    assert transcript.finish_reasons == {"a": "length", "b": "length", "c": "length"}


def test_preemption_does_not_change_any_output(make_scheduler):
    def workload():
        return [make_request(f"r{i}", prompt, max_tokens=9) for i, prompt in enumerate(prompts)]

    prompts = [fresh_prompt(n) for n in (5, 9, 3, 12, 7, 6)]
    roomy = make_scheduler(num_blocks=64)
    tight = make_scheduler(num_blocks=8, log_stats=True)
    results = []
    for scheduler in (roomy, tight):
        for request in workload():
            scheduler.add_request(request)
        results.append(run_until_idle(scheduler))
    assert tight.num_preemptions > 0
    assert tight.make_stats().num_preemptions == tight.num_preemptions
    assert results[0].tokens == results[1].tokens
    assert results[0].finish_reasons == results[1].finish_reasons


def test_priority_preemption_evicts_the_worst_priority_request_even_if_already_scheduled(make_scheduler):
    scheduler = make_scheduler(policy="priority", num_blocks=6)
    worst = make_request("worst", 4, max_tokens=8, priority=10)
    scheduler.add_request(worst)
    run_step(scheduler)
    best, middle = (
        make_request("best", 8, max_tokens=4, priority=0),
        make_request("middle", 8, max_tokens=4, priority=5),
    )
    scheduler.add_request(best)
    scheduler.add_request(middle)
    assert run_step(scheduler).scheduled == {"worst": 1, "best": 8, "middle": 8}
    assert [r.request_id for r in scheduler.running] == ["worst", "best", "middle"]
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # best needs a new block; worst (priority 10) is evicted though it runs first and was scheduled.
    step = run_step(scheduler)
    assert step.scheduler_output.preempted_req_ids == {"worst"}
    assert step.scheduled == {"best": 1, "middle": 1}
    assert step.scheduler_output.total_num_scheduled_tokens == 2
    assert step.scheduler_output.scheduled_cached_reqs.req_ids == ["best", "middle"]
    assert worst.status == RequestStatus.PREEMPTED and worst.num_computed_tokens == 0
    assert step.output_of("worst") is None

    run_until_idle(scheduler)
    for request in (worst, best, middle):
        assert request.output_token_ids == reference_output(request)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted(make_scheduler):
    scheduler = make_scheduler(policy="priority", num_blocks=7)
    worst = make_request("worst", 11, max_tokens=8, priority=10)
    scheduler.add_request(worst)
    run_step(scheduler)
    scheduler.add_request(make_request("best", 8, max_tokens=4, priority=0))
    scheduler.add_request(make_request("middle", 8, max_tokens=4, priority=5))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # worst needs a 4th block and is itself the victim; its 3 blocks would fit the newcomer,
    # but admitting work in a step that had to preempt would only thrash.
    scheduler.add_request(make_request("newcomer", 3, max_tokens=2, priority=0))
    step = run_step(scheduler)
    assert step.scheduler_output.preempted_req_ids == {"worst"}
    assert "newcomer" not in step.scheduled
    assert scheduler.requests["newcomer"].status == RequestStatus.WAITING
    assert "newcomer" in run_step(scheduler).scheduled
    run_until_idle(scheduler)
    assert worst.output_token_ids == reference_output(worst)


# ------------------------------------------------------------------------------ prefix cache


def test_second_request_with_the_same_prefix_hits_the_prefix_cache(make_scheduler):
    scheduler = make_scheduler()
    shared = fresh_prompt(8)
    first = make_request("first", shared + fresh_prompt(2), max_tokens=2)
    scheduler.add_request(first)
    run_until_idle(scheduler)
    assert first.num_cached_tokens == 0

    second = make_request("second", shared + fresh_prompt(3), max_tokens=2)
    scheduler.add_request(second)
    step = run_step(scheduler)
    assert second.num_cached_tokens == 8
    assert step.scheduled == {"second": 3}
    assert step.scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 8
    assert step.output_of("second").num_cached_tokens == 8
    run_until_idle(scheduler)
    assert second.output_token_ids == reference_output(second)


def test_the_last_prompt_token_is_never_a_prefix_cache_hit(make_scheduler):
    scheduler = make_scheduler()
    prompt = fresh_prompt(8)  # exactly two full blocks
    scheduler.add_request(make_request("first", prompt, max_tokens=1))
    run_until_idle(scheduler)
    again = make_request("again", prompt, max_tokens=1)
    scheduler.add_request(again)
    step = run_step(scheduler)
    # The second block would cover the last token, whose logits are needed: only the first hits.
    assert again.num_cached_tokens == 4
    assert step.scheduled == {"again": 4}
    run_until_idle(scheduler)


def test_concurrent_requests_share_prefix_blocks(make_scheduler):
    scheduler = make_scheduler(num_blocks=16)
    shared = fresh_prompt(8)
    scheduler.add_request(make_request("a", shared + fresh_prompt(1), max_tokens=4))
    run_step(scheduler)
    scheduler.add_request(make_request("b", shared + fresh_prompt(1), max_tokens=4))
    step = run_step(scheduler)
    assert step.scheduled == {"a": 1, "b": 1}
    a_blocks = scheduler.kv_cache_manager.get_block_ids("a")
    b_blocks = scheduler.kv_cache_manager.get_block_ids("b")
    assert a_blocks[:2] == b_blocks[:2]
    assert a_blocks[2] != b_blocks[2]
    assert scheduler.kv_cache_manager.usage == pytest.approx(4 / 16)
    run_until_idle(scheduler)


def test_prefix_caching_disabled_schedules_the_whole_prompt(make_scheduler):
    scheduler = make_scheduler(enable_prefix_caching=False)
    prompt = fresh_prompt(10)
    scheduler.add_request(make_request("first", prompt, max_tokens=1))
    run_until_idle(scheduler)
    again = make_request("again", prompt, max_tokens=1)
    scheduler.add_request(again)
    assert run_step(scheduler).scheduled == {"again": 10}
    assert again.num_cached_tokens == 0
    run_until_idle(scheduler)


def test_reset_prefix_cache_refuses_while_running_and_forgets_prefixes_when_idle(make_scheduler):
    scheduler = make_scheduler()
    prompt = fresh_prompt(9)
    scheduler.add_request(make_request("first", prompt, max_tokens=2))
    run_step(scheduler)
    assert scheduler.reset_prefix_cache() is False
    run_until_idle(scheduler)
    assert scheduler.reset_prefix_cache() is True
    again = make_request("again", prompt, max_tokens=1)
    scheduler.add_request(again)
    assert run_step(scheduler).scheduled == {"again": 9}
    run_until_idle(scheduler)


# ------------------------------------------------------------------------------ stopping


def _eos_as_third_token(request):
    return EOS if request.num_output_tokens == 2 else next_token(request)


def test_eos_stops_the_request(make_scheduler):
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=10)
    scheduler.add_request(request)
    transcript = run_until_idle(scheduler, _eos_as_third_token)
    assert transcript.tokens["r"][-1] == EOS
    assert len(transcript.tokens["r"]) == 3
    assert transcript.finish_reasons == {"r": "stop"}
    assert transcript.stop_reasons == {"r": None}
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_generating_until_max_tokens(make_scheduler):
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=6, ignore_eos=True)
    scheduler.add_request(request)
    transcript = run_until_idle(scheduler, _eos_as_third_token)
    assert len(transcript.tokens["r"]) == 6
    assert transcript.tokens["r"][2] == EOS
    assert transcript.finish_reasons == {"r": "length"}


def test_a_request_without_eos_token_id_does_not_stop_on_eos(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 5, max_tokens=4, eos_token_id=None))
    transcript = run_until_idle(scheduler, _eos_as_third_token)
    assert len(transcript.tokens["r"]) == 4
    assert transcript.finish_reasons == {"r": "length"}


def test_stop_token_id_stops_with_the_token_as_stop_reason(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 5, max_tokens=10, stop_token_ids=[77, 78]))
    transcript = run_until_idle(scheduler, lambda r: 78 if r.num_output_tokens == 1 else next_token(r))
    assert transcript.tokens["r"][-1] == 78
    assert len(transcript.tokens["r"]) == 2
    assert transcript.finish_reasons == {"r": "stop"}
    assert transcript.stop_reasons == {"r": 78}


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_caps_the_output(make_scheduler, max_tokens):
    scheduler = make_scheduler()
    request = make_request("r", 6, max_tokens=max_tokens)
    scheduler.add_request(request)
    transcript = run_until_idle(scheduler)
    assert transcript.tokens["r"] == reference_output(request)
    assert len(transcript.tokens["r"]) == max_tokens
    assert transcript.finish_reasons == {"r": "length"}


def test_max_model_len_caps_prompt_plus_output(make_scheduler):
    scheduler = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    request = make_request("r", 12, max_tokens=100)
    scheduler.add_request(request)
    transcript = run_until_idle(scheduler)
    assert len(transcript.tokens["r"]) == 4
    assert request.num_tokens == 16
    assert transcript.finish_reasons == {"r": "length"}
    assert scheduler.kv_cache_manager.num_blocks_of("r") == 0


# ------------------------------------------------------------------------------ finishing from outside


def test_finish_requests_from_waiting(make_scheduler):
    scheduler = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5, max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.finish_requests("a")
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert "a" not in scheduler.requests
    assert list(scheduler.waiting) == [b]
    assert scheduler.get_request_counts() == (0, 1)
    step = run_step(scheduler)
    assert step.scheduled == {"b": 5}
    assert "a" in step.scheduler_output.finished_req_ids
    run_until_idle(scheduler)


def test_finish_requests_from_running_with_many_ids_ignoring_unknown_ones(make_scheduler):
    scheduler = make_scheduler()
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 6, max_tokens=10))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests(["a", "no-such-request", "c"])
    assert [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.kv_cache_manager.num_blocks_of("a") == 0
    assert scheduler.kv_cache_manager.num_blocks_of("c") == 0
    step = run_step(scheduler)
    assert step.scheduled == {"b": 1}
    assert step.scheduler_output.finished_req_ids == {"a", "c"}
    scheduler.finish_requests(("b",))
    assert scheduler.get_request_counts() == (0, 0)


def test_finish_requests_ignores_unknown_and_already_finished_ids(make_scheduler):
    scheduler = make_scheduler()
    scheduler.finish_requests("never-added")
    scheduler.finish_requests([])
    request = make_request("r", 5, max_tokens=1)
    scheduler.add_request(request)
    run_until_idle(scheduler)
    scheduler.finish_requests(["r", "r"])
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not scheduler.has_unfinished_requests()


def test_finish_requests_from_preempted(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(3):
        run_step(scheduler)
    assert b.status == RequestStatus.PREEMPTED
    scheduler.finish_requests("b")
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.get_request_counts() == (1, 0)
    transcript = run_until_idle(scheduler)
    assert "b" not in transcript.tokens
    assert a.output_token_ids == reference_output(a)


def test_finish_requests_between_schedule_and_update(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=5))
    scheduler.add_request(make_request("b", 6, max_tokens=5))
    run_step(scheduler)
    scheduler_output = scheduler.schedule()
    scheduler.finish_requests("a")
    outputs = scheduler.update_from_output(
        scheduler_output, model_runner_output_for(scheduler, scheduler_output)
    )
    assert [o.request_id for o in outputs[0].outputs] == ["b"]
    assert "a" in scheduler.schedule().finished_req_ids
    scheduler.finish_requests("b")


def test_finish_requests_with_a_given_status(make_scheduler):
    scheduler = make_scheduler()
    request = make_request("r", 5)
    scheduler.add_request(request)
    run_step(scheduler)
    scheduler.finish_requests("r", RequestStatus.FINISHED_STOPPED)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.get_finished_reason() == "stop"


# ------------------------------------------------------------------------------ introspection


def test_request_presence_queries_follow_the_request_life(make_scheduler):
    scheduler = make_scheduler()
    assert not scheduler.has_requests()
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.has_finished_requests()
    scheduler.add_request(make_request("r", 5, max_tokens=2))
    assert scheduler.has_requests() and scheduler.has_unfinished_requests()
    assert not scheduler.has_finished_requests()
    assert scheduler.get_num_unfinished_requests() == 1
    run_step(scheduler)
    run_step(scheduler)  # finishes r
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_num_unfinished_requests() == 0
    # Finished but not yet reported to the runner: the engine must step once more.
    assert scheduler.has_finished_requests()
    assert scheduler.has_requests()
    output = scheduler.schedule()
    assert output.finished_req_ids == {"r"}
    assert output.total_num_scheduled_tokens == 0
    assert not scheduler.has_finished_requests()
    assert not scheduler.has_requests()
    assert scheduler.schedule().finished_req_ids == set()


def test_get_request_counts_is_running_then_waiting(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=2))
    assert scheduler.get_request_counts() == (0, 5)
    run_step(scheduler)
    assert scheduler.get_request_counts() == (2, 3)
    assert scheduler.get_num_unfinished_requests() == 5
    run_until_idle(scheduler)
    assert scheduler.get_request_counts() == (0, 0)


def test_make_stats_reports_counts_and_usage_with_log_stats(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=16, log_stats=True)
    prompt = fresh_prompt(9)
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    scheduler.add_request(make_request("b", prompt, max_tokens=3))
    scheduler.add_request(make_request("c", 6, max_tokens=3))
    step = run_step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == scheduler.kv_cache_manager.usage > 0
    assert stats.num_preemptions == 0
    # The step's outputs carry a snapshot too, with cumulative prefix-cache counters:
    # b arrived in the same step as a and hit a's two full blocks.
    step_stats = step.engine_outputs[0].scheduler_stats
    assert (step_stats.prefix_cache_queries, step_stats.prefix_cache_hits) == (18, 8)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    run_until_idle(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_make_stats_is_none_without_log_stats(make_scheduler):
    scheduler = make_scheduler()
    assert scheduler.make_stats() is None
    scheduler.add_request(make_request("r", 4, max_tokens=1))
    step = run_step(scheduler)
    assert step.engine_outputs[0].scheduler_stats is None


def test_shutdown_shuts_the_connector_down(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    assert scheduler.get_kv_connector() is connector
    scheduler.shutdown()
    assert connector.shut_down


# ------------------------------------------------------------------------------ randomized workloads


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
)
def test_random_workloads_respect_the_budget_finish_correctly_and_free_every_block(
    data, block_size, chunked, policy, max_num_seqs, prefix_caching
):
    max_model_len = 32
    budget = data.draw(st.integers(max(max_num_seqs, 1 if chunked else max_model_len), 48), label="budget")
    threshold = data.draw(st.sampled_from([0, 0, 3, 8]), label="threshold")
    min_blocks = -(-max_model_len // block_size)
    num_blocks = data.draw(st.integers(min_blocks, 3 * min_blocks), label="num_blocks")
    scheduler = SchedulerFactory()(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        policy=policy,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix_caching,
    )
    shared = fresh_prompt(12)
    specs = data.draw(
        st.lists(
            st.tuples(st.integers(0, 12), st.integers(1, 12), st.integers(1, 12), st.integers(0, 3)),
            min_size=1,
            max_size=8,
        ),
        label="requests",
    )
    requests = []
    for i, (shared_len, own_len, max_tokens, priority) in enumerate(specs):
        request = make_request(
            f"r{i}", shared[:shared_len] + fresh_prompt(own_len), max_tokens=max_tokens, priority=priority
        )
        requests.append(request)
        scheduler.add_request(request)
    transcript = run_until_idle(scheduler, max_steps=2_000)
    for request in requests:
        expected = reference_output(request)[: max_model_len - request.num_prompt_tokens]
        assert transcript.tokens[request.request_id] == expected
        assert transcript.finish_reasons[request.request_id] == "length"
    for step in transcript.steps:
        if not chunked and threshold == 0:
            # Without chunking, a first prefill is always the whole (uncached) prompt.
            for new in step.scheduler_output.scheduled_new_reqs:
                request = next(r for r in requests if r.request_id == new.req_id)
                num_tokens = request.num_prompt_tokens + len(new.output_token_ids)
                assert new.num_computed_tokens + step.scheduled[new.req_id] == num_tokens
        if threshold:
            assert all(n <= threshold for n in step.scheduled.values())
    scheduler.schedule()
    assert_idle_and_no_leak(scheduler)
