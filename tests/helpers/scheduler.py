"""Shared helpers for the scheduler unit tests: a fake model step, a hand-driven KV connector,
and a scheduler factory that checks every KV block came back once the test is over.

No model runs here. ``next_token`` stands in for the model: the token it picks depends only on the
request's tokens so far, so a request's output is the same however the scheduler batched,
chunked or preempted it, and a test can compare against ``reference_output``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.connector.base import KVConnectorBase, KVConnectorMetadata
from pdserve.engine.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import Scheduler

EOS = 2

SampleFn = Callable[[Request], int]


def next_token(request: Request) -> int:
    """The fake model: a token in [100, 1000) that depends on every token the request has, in order.

    (Tuples of ints hash the same in every process, so this is deterministic.)"""
    return 100 + hash(tuple(request.all_token_ids)) % 900


# Fresh token ids for prompts that must not share a prefix with any other test's prompt.
_fresh_ids = itertools.count(1_000)


def fresh_prompt(num_tokens: int) -> list[int]:
    return [next(_fresh_ids) for _ in range(num_tokens)]


def make_request(
    request_id: str,
    prompt: int | list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    eos_token_id: int | None = EOS,
    **sampling: Any,
) -> Request:
    """A request whose prompt is ``prompt`` (a list) or that many fresh tokens (an int)."""
    tokens = fresh_prompt(prompt) if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_time=arrival_time,
        priority=priority,
        kv_transfer_params=kv_transfer_params,
        eos_token_id=eos_token_id,
    )


def reference_output(request: Request, sampled_token_fn: SampleFn = next_token) -> list[int]:
    """What ``request`` generates when nothing gets in its way (stops on EOS unless ignored,
    on a stop token, at ``max_tokens``; ``max_model_len`` is the caller's business)."""
    shadow = Request("shadow", request.prompt_token_ids, request.sampling_params)
    params = request.sampling_params
    while shadow.num_output_tokens < params.max_tokens:
        token = sampled_token_fn(shadow)
        shadow.append_output_token_ids(token)
        if (not params.ignore_eos and token == request.eos_token_id) or token in params.stop_token_ids:
            break
    return shadow.output_token_ids


# ---------------------------------------------------------------------------------------- steps


@dataclass
class Step:
    """One ``schedule()`` + ``update_from_output()`` round."""

    scheduler_output: SchedulerOutput
    engine_outputs: dict[int, EngineCoreOutputs]

    @property
    def scheduled(self) -> dict[str, int]:
        return self.scheduler_output.num_scheduled_tokens

    def outputs(self, client_index: int = 0) -> list:
        group = self.engine_outputs.get(client_index)
        return group.outputs if group is not None else []

    def output_of(self, request_id: str):
        found = [
            o for group in self.engine_outputs.values() for o in group.outputs if o.request_id == request_id
        ]
        assert len(found) <= 1, f"{request_id} has {len(found)} outputs in one step"
        return found[0] if found else None


def check_step_invariants(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> None:
    """What must hold after every ``schedule()``: the budget, the sequence cap, consistent totals."""
    config = scheduler.scheduler_config
    scheduled = scheduler_output.num_scheduled_tokens
    assert sum(scheduled.values()) == scheduler_output.total_num_scheduled_tokens
    assert scheduler_output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(n > 0 for n in scheduled.values())
    assert len(scheduler.running) <= config.max_num_seqs
    new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    cached_ids = set(scheduler_output.scheduled_cached_reqs.req_ids)
    assert not new_ids & cached_ids
    assert new_ids | cached_ids == set(scheduled)


def model_runner_output_for(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    sampled_token_fn: SampleFn = next_token,
    *,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    invalid_block_ids: Iterable[int] | None = None,
) -> ModelRunnerOutput:
    """A token for each scheduled request whose prefill is complete, nothing for partial chunks."""
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    for req_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            continue  # finished (aborted) between schedule() and the model step
        req_ids.append(req_id)
        prefill_done = request.num_computed_tokens >= request.num_tokens
        sampled.append([sampled_token_fn(request)] if prefill_done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        finished_sending=set(finished_sending) if finished_sending is not None else None,
        finished_recving=set(finished_recving) if finished_recving is not None else None,
        invalid_block_ids=set(invalid_block_ids) if invalid_block_ids is not None else None,
    )


def run_step(
    scheduler: Scheduler,
    sampled_token_fn: SampleFn = next_token,
    *,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    invalid_block_ids: Iterable[int] | None = None,
) -> Step:
    """Schedule, check the step's invariants, fake the forward pass, and apply its output."""
    scheduler_output = scheduler.schedule()
    check_step_invariants(scheduler, scheduler_output)
    runner_output = model_runner_output_for(
        scheduler,
        scheduler_output,
        sampled_token_fn,
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        invalid_block_ids=invalid_block_ids,
    )
    return Step(scheduler_output, scheduler.update_from_output(scheduler_output, runner_output))


@dataclass
class Transcript:
    """Everything the scheduler sent back, per request, across steps."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    stop_reasons: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    def record(self, step: Step) -> Step:
        self.steps.append(step)
        for group in step.engine_outputs.values():
            for output in group.outputs:
                assert output.request_id not in self.finish_reasons, (
                    f"{output.request_id} output after finishing"
                )
                self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    self.finish_reasons[output.request_id] = output.finish_reason
                    self.stop_reasons[output.request_id] = output.stop_reason
                if output.kv_transfer_params is not None:
                    self.kv_transfer_params[output.request_id] = output.kv_transfer_params
        return step


def run_until_idle(
    scheduler: Scheduler,
    sampled_token_fn: SampleFn = next_token,
    *,
    transcript: Transcript | None = None,
    max_steps: int = 1_000,
) -> Transcript:
    """Step until no request is waiting or running (held blocks are the caller's business)."""
    transcript = transcript if transcript is not None else Transcript()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return transcript
        transcript.record(run_step(scheduler, sampled_token_fn))
    raise AssertionError(f"not idle after {max_steps} steps: {scheduler.get_request_counts()}")


# ---------------------------------------------------------------------------------------- connector


class FakeConnector(KVConnectorBase):
    """A KV connector whose remote loads finish only when a test says so.

    Decode side: a request with ``kv_transfer_params["do_remote_prefill"]`` gets its uncached
    prompt tokens "from a remote engine", asynchronously, once (like vLLM's NIXL connector).
    The test completes or fails the load by passing ``finished_recving`` / ``invalid_block_ids``
    to ``run_step``, as the worker side would report them.
    Prefill side: a request with ``kv_transfer_params["do_remote_decode"]`` that finishes
    normally is held (``delay_free``) and returns params for the decode engine; the test
    releases it with ``finished_sending``.
    With ``delay_free_aborted_loads``, an aborted request whose load was started is held too
    (its blocks may still be being written).

    Deliberately does not call ``super().__init__()``: the scheduler must rely on no base state.
    """

    def __init__(self, *, delay_free_aborted_loads: bool = False) -> None:
        self.delay_free_aborted_loads = delay_free_aborted_loads
        self.matched_calls: list[tuple[str, int]] = []  # [(req_id, num_computed_tokens)]
        self.alloc_calls: list[tuple[str, list[int], int]] = []  # [(req_id, block_ids, num_external)]
        self.loads_started: dict[str, list[int]] = {}  # {req_id: block ids to fill}
        self.finished_calls: list[tuple[str, list[int], RequestStatus]] = []
        self.released: list[str] = []
        self.num_metadata_built = 0
        self.shut_down = False

    # scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.matched_calls.append((request.request_id, num_computed_tokens))
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and request.request_id not in self.loads_started:
            remaining = request.num_prompt_tokens - num_computed_tokens
            if remaining > 0:
                return remaining, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.alloc_calls.append((request.request_id, list(block_ids), num_external_tokens))
        if num_external_tokens > 0:
            self.loads_started[request.request_id] = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.num_metadata_built += 1
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append((request.request_id, list(block_ids), request.status))
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return True, {
                "do_remote_prefill": True,
                "remote_engine_id": "fake-prefill",
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "remote_block_ids": list(block_ids),
                "num_tokens": request.num_prompt_tokens,
            }
        if (
            self.delay_free_aborted_loads
            and request.status == RequestStatus.FINISHED_ABORTED
            and request.request_id in self.loads_started
        ):
            return True, None
        return False, None

    def request_released(self, request_id: str) -> None:
        self.released.append(request_id)

    def shutdown(self) -> None:
        self.shut_down = True

    # worker side (unused: the tests play the worker through ModelRunnerOutput)

    def register_kv_caches(self, kv_cache) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, metadata: KVConnectorMetadata) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None


# ---------------------------------------------------------------------------------------- schedulers


def assert_idle_and_no_leak(scheduler: Scheduler) -> None:
    """The DESIGN.md invariant: an idle engine has every block free or cached with ref count 0."""
    assert not scheduler.has_unfinished_requests(), scheduler.get_request_counts()
    assert scheduler.requests == {}, f"requests still holding state: {sorted(scheduler.requests)}"
    assert scheduler.kv_cache_manager.usage == 0.0
    pool = scheduler.kv_cache_manager.block_pool
    assert [b.block_id for b in pool.blocks if b.ref_cnt != 0] == []
    assert pool.num_free_blocks == pool.num_blocks


class SchedulerFactory:
    """Builds small schedulers (block_size 4 by default) and remembers them for the idle check."""

    def __init__(self) -> None:
        self.created: list[Scheduler] = []

    def __call__(
        self,
        *,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 64,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        kv_load_failure_policy: str = "recompute",
        handover_step: str = "joined",
        block_size: int = 4,
        num_blocks: int = 64,
        enable_prefix_caching: bool = True,
        connector: KVConnectorBase | None = None,
        log_stats: bool = False,
    ) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                policy=policy,
                kv_load_failure_policy=kv_load_failure_policy,
                handover_step=handover_step,
            ),
            CacheConfig(
                block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
            ),
            connector=connector,
            log_stats=log_stats,
        )
        self.created.append(scheduler)
        return scheduler

    def assert_all_idle(self) -> None:
        for scheduler in self.created:
            assert_idle_and_no_leak(scheduler)


def scheduler_factory_fixture(request):
    """Body of each test module's ``make_scheduler`` fixture: the idle/no-leak check runs after
    the test (skipped for xfail-marked tests, whose known bug may leave blocks behind)."""
    factory = SchedulerFactory()
    yield factory
    if request.node.get_closest_marker("xfail") is None:
        factory.assert_all_idle()
