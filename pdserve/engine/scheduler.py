"""vLLM-v1-style scheduler: continuous batching over a paged KV cache. It only decides.

Each step it spends a token budget on running requests first (decodes and prefill chunks),
then admits waiting ones, preempting by recompute when blocks run out. Prefix-cache hits and
remote KV (the P/D connector) both count as already-computed tokens. A decode engine's request
whose KV is still in flight sits in ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated; a
prefill engine's finished request may keep its blocks (``delay_free``) until the connector says
the remote reader is done.

KV blocks reported invalid by the worker (a failed load, synchronous or not) roll every request
holding one back to its first invalid block, dropping a token sampled over them, or fail it
(``kv_load_failure_policy``); the blocks leave the prefix cache either way.

Where this follows the seed scheduler (vLLM v1 as of the seed) rather than newer vLLM, or
differs on purpose:

- With chunked prefill off, a waiting prompt longer than the remaining budget is skipped
  (``continue``: shorter requests behind it may still be admitted), as in the seed; newer vLLM
  stops admitting (``break``).
- A step that had to preempt admits no waiting request (as vLLM), and a waiting request that
  cannot get blocks stops admission for the step: no overtaking.
- Prefix-cache queries and hits are counted once per admission (when the request gets its
  blocks), not per lookup: a request waiting for blocks is looked up again every step.
- A connector answering ``(0, True)`` (an asynchronous load of nothing) is a contract violation;
  it is logged once, naming the connector, and treated as ``(0, False)`` rather than parking the
  request in WAITING_FOR_REMOTE_KVS with nothing to wake it.
- A running request rolled back over invalid blocks is sent to the runner as a new request
  (its full block table and tokens) so the runner's copy drops the discarded token too.
- ``check_stop`` looks at EOS and the stop ids before the length limits (newer vLLM checks the
  length first): a request whose last allowed token is EOS finishes "stop", not "length".
- Invalid blocks of a request that already finished and is held for a remote reader (a prefill
  engine's lease) are only taken out of the prefix cache; the reader's own validation decides.
- ``handover_step="joined"`` is vLLM's behaviour: a request whose remote KV has landed runs in
  the next batch step.
- ``handover_step="separate"`` (opt-in): requests
  whose remote KV has landed run in a step of their own before the next batch step, at most one
  such step in ``HANDOVER_STEP_MIN_GAP``. Joined, a landed request's second token waits the rest
  of the step in flight plus a whole batch step; separate, the rest of the step plus a small
  step, and every running request's next token waits that small step. On this CPU a one-request
  step costs ~2/3 of a batch step (weights dominate), so it is a trade, not a free win:
  measured in ``bench handover`` (docs/performance.md), the handover p50 fell 14-34% and the
  running requests' mean inter-token gap rose 10-16%.
- ``handover_step="inflight"`` (the default) does not wait for a step boundary: between two decoder
  layers of a step (while at most half of them have run) the engine core lets a request whose
  KV has landed join that very step (``join_landed``); the runner first runs the layers it
  missed for that row alone. Its second token then costs the rest of the step in flight plus
  a fraction of a small step, and the running requests wait only that fraction, once.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.connector.base import KVConnectorBase
from pdserve.engine.interface import SchedulerInterface
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.request_queue import create_request_queue

logger = logging.getLogger(__name__)

# With handover_step="separate": at most one step in this many runs only newly landed requests
# (so arrivals can take at most that share of the steps from the running requests).
HANDOVER_STEP_MIN_GAP = 4


@dataclass
class _Step:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status if the last token ends the request; True if it does."""
    params = request.sampling_params
    last_token = request.output_token_ids[-1]
    # Before min_tokens only the length limits end a request (the sampler also masks EOS and
    # the stop ids until then).
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token
            return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorBase | None = None,
        log_stats: bool = False,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.connector = connector
        self.log_stats = log_stats
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}  # every request that still holds state
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner must drop their cached state.
        self.finished_req_ids: set[str] = set()
        # Finished requests whose blocks the connector still needs (a remote decode reading them).
        self.held_req_ids: set[str] = set()
        # Remote loads reported done by the worker; consumed when the request is next considered.
        self.finished_recving_kv_req_ids: set[str] = set()
        # {req_id: tokens that will be valid once its remote KV has landed (local hit + remote)}
        self.pending_remote_tokens: dict[str, int] = {}
        # Outputs produced outside a model step (e.g. a failed KV load), sent with the next update:
        # [(client_index, output)]
        self.pending_outputs: list[tuple[int, EngineCoreOutput]] = []
        # Running requests rolled back over invalid KV blocks: the runner's copy of each (which
        # holds the dropped token) is replaced by a full new-request record when next scheduled.
        self.resync_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._warned_empty_async_load = False
        self._steps_since_handover_step = HANDOVER_STEP_MIN_GAP  # steps since one ran only landed requests

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.mark("received")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        assert RequestStatus.is_finished(finished_status)
        ids = (request_ids,) if isinstance(request_ids, str) else set(request_ids)
        to_free: list[Request] = []
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.is_finished():
                # Already finished, blocks held for a remote reader: an abort releases them now.
                if req_id in self.held_req_ids:
                    if self.connector is not None:
                        self.connector.request_released(req_id)
                    self._free_blocks(request)
                continue
            to_free.append(request)
        running = [r for r in to_free if r.status == RequestStatus.RUNNING]
        if running:
            gone = set(running)
            self.running = [r for r in self.running if r not in gone]
        waiting = [r for r in to_free if r.status != RequestStatus.RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in to_free:
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """A request just finished: tell the connector, and free its blocks unless it holds them."""
        assert request.is_finished()
        delay_free, kv_transfer_params = False, None
        if self.connector is not None:
            delay_free, kv_transfer_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)
            )
        self.finished_req_ids.add(request.request_id)
        # A load that already landed writes nothing more: no reason to hold its blocks.
        if delay_free and request.request_id not in self.finished_recving_kv_req_ids:
            self.held_req_ids.add(request.request_id)
        else:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        req_id = request.request_id
        self.requests.pop(req_id, None)
        self.held_req_ids.discard(req_id)
        self.pending_remote_tokens.pop(req_id, None)
        self.finished_recving_kv_req_ids.discard(req_id)
        self.resync_req_ids.discard(req_id)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        config = self.scheduler_config
        step = _Step(token_budget=config.max_num_batched_tokens)
        if self._handover_step_due():
            # Only the requests whose remote KV has landed: their first decode token then costs
            # a small step instead of a full batch step; the running requests wait this one.
            self._schedule_waiting(step, only_landed=True)
        if step.num_scheduled_tokens:
            self._steps_since_handover_step = 0
        else:  # an ordinary step (also when the landed requests could not be scheduled)
            self._schedule_running(step)
            self._schedule_waiting(step, only_landed=False)
        self._steps_since_handover_step += 1
        num_scheduled_tokens = step.num_scheduled_tokens
        req_to_new_block_ids = step.req_to_new_block_ids
        scheduled_running = step.scheduled_running  # minus the resynced ones, below

        total = sum(num_scheduled_tokens.values())
        assert total <= config.max_num_batched_tokens and step.token_budget >= 0
        assert len(self.running) <= config.max_num_seqs

        resynced = [r for r in scheduled_running if r.request_id in self.resync_req_ids]
        if resynced:
            self.resync_req_ids.difference_update(r.request_id for r in resynced)
            scheduled_running = [r for r in scheduled_running if r not in resynced]
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, self.kv_cache_manager.get_block_ids(r.request_id))
                for r in resynced
            ]
            + [
                NewRequestData.from_request(r, req_to_new_block_ids[r.request_id]) for r in step.scheduled_new
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in scheduled_running],
                resumed_from_preemption=[False] * len(scheduled_running),
                new_block_ids=[req_to_new_block_ids[r.request_id] for r in scheduled_running],
                num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted},
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)

        # Advance progress now so the next schedule() can continue a chunked prefill at once.
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return output

    def _handover_step_due(self) -> bool:
        """Whether this step runs only the requests whose remote KV has just landed.

        With ``handover_step="separate"``, when some have landed and running requests have work
        too, and no such step ran in the last ``HANDOVER_STEP_MIN_GAP`` steps (so a stream of
        arrivals cannot take more than that share of the steps from the running requests).
        """
        if self.scheduler_config.handover_step != "separate":
            return False
        if self._steps_since_handover_step < HANDOVER_STEP_MIN_GAP:
            return False
        landed = any(
            (request := self.requests.get(req_id)) is not None
            and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            for req_id in self.finished_recving_kv_req_ids
        )
        return landed and any(r.num_tokens > r.num_computed_tokens for r in self.running)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests first: decodes and the next chunk of partial prefills."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, step.token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_block_ids is not None:
                    break
                victim = self._pick_preemption_victim()
                if victim in step.scheduled_running:
                    # Already scheduled this step (priority policy): give its tokens back.
                    step.scheduled_running.remove(victim)
                    step.token_budget += step.num_scheduled_tokens.pop(victim.request_id)
                    step.req_to_new_block_ids.pop(victim.request_id, None)
                    req_index -= 1
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
            if new_block_ids is None:
                break
            step.scheduled_running.append(request)
            step.req_to_new_block_ids[request.request_id] = new_block_ids
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens
            req_index += 1

    def _schedule_waiting(self, step: _Step, only_landed: bool) -> None:
        """Admit waiting requests, unless this step had to preempt (no room to admit anyone);
        ``only_landed``: only those whose remote KV has landed (a handover step)."""
        config = self.scheduler_config
        threshold = config.long_prefill_token_threshold
        skipped = create_request_queue(config.policy)
        while not step.preempted and self.waiting and step.token_budget > 0:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self.waiting.peek_request()
            if only_landed and not (
                request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and request.request_id in self.finished_recving_kv_req_ids
            ):
                skipped.add_request(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._remote_kv_ready(request):
                    skipped.add_request(self.waiting.pop_request())
                    continue
                request.status = RequestStatus.WAITING

            load_kv_async = False
            num_external_tokens = 0
            computed_blocks: list = []
            num_local_tokens = 0
            first_lookup = self.kv_cache_manager.num_blocks_of(request.request_id) == 0
            if first_lookup:
                computed_blocks, num_local_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None:
                    num_external_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                        request, num_local_tokens
                    )
                    if load_kv_async and num_external_tokens == 0:
                        load_kv_async = self._refuse_empty_async_load()
                num_computed_tokens = num_local_tokens + num_external_tokens
            else:
                # Remote KV has landed (or failed and is being recomputed) into blocks it holds.
                num_computed_tokens = request.num_computed_tokens

            if load_kv_async:
                num_new_tokens = 0  # nothing to compute until the blocks arrive
            else:
                num_new_tokens = request.num_tokens - num_computed_tokens
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not config.enable_chunked_prefill and num_new_tokens > step.token_budget:
                    skipped.add_request(self.waiting.pop_request())
                    continue
                num_new_tokens = min(num_new_tokens, step.token_budget)
                assert num_new_tokens > 0

            new_block_ids = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens + num_external_tokens,
                num_local_tokens,
                computed_blocks,
                delay_cache_blocks=load_kv_async,
            )
            if new_block_ids is None:
                break  # out of blocks: later requests wait too (no overtaking)
            if first_lookup:
                self.kv_cache_manager.record_prefix_query(request.num_tokens, num_local_tokens)
                if request.num_prefix_hit_tokens < 0:
                    request.num_prefix_hit_tokens = num_local_tokens

            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), num_external_tokens
                )
            self.waiting.pop_request()
            request.mark("admitted")
            if load_kv_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.pending_remote_tokens[request.request_id] = num_computed_tokens
                skipped.add_request(request)
                continue

            self._start_running(request, num_computed_tokens)
            step.scheduled_new.append(request)
            step.req_to_new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(
                request.request_id
            )
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens

        if skipped:
            self.waiting.prepend_requests(skipped)

    def admit_remote_loads(self) -> Any:
        """Give waiting requests whose prompt KV sits on a remote engine their blocks now, and
        return the connector metadata that starts their pulls (None if there is none).

        The engine core calls this between two ``schedule()`` calls, while the runner is in the
        middle of a step, as soon as such a request arrives: its pull then overlaps the step in
        flight instead of starting with the next one, and the request runs in the step after
        (vLLM starts loads only at a step boundary, costing a decode engine under load one more
        step per handover). Only blocks are allocated: nothing is scheduled and no token budget
        is used; the request still enters a batch through ``schedule()`` once its KV has landed.
        Requests whose prompt is computed locally (a full local prefix hit) are left to
        ``schedule()``, as is everything once ``max_num_seqs`` requests run.
        """
        if self.connector is None or len(self.running) >= self.scheduler_config.max_num_seqs:
            return None
        admitted = 0
        for request in list(self.waiting):
            if request.status != RequestStatus.WAITING or not (request.kv_transfer_params or {}).get(
                "do_remote_prefill"
            ):
                continue
            if self.kv_cache_manager.num_blocks_of(request.request_id) != 0:
                continue
            computed_blocks, num_local_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_external_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                request, num_local_tokens
            )
            if not load_kv_async or num_external_tokens == 0:
                continue
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_external_tokens, num_local_tokens, computed_blocks, delay_cache_blocks=True
            )
            if new_block_ids is None:
                break  # out of blocks: schedule() decides who gets them
            self.kv_cache_manager.record_prefix_query(request.num_tokens, num_local_tokens)
            if request.num_prefix_hit_tokens < 0:
                request.num_prefix_hit_tokens = num_local_tokens
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_block_ids(request.request_id), num_external_tokens
            )
            request.mark("admitted")
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.pending_remote_tokens[request.request_id] = num_local_tokens + num_external_tokens
            admitted += 1
        # Nothing is scheduled here: the connector only needs the loads queued above.
        return self.connector.build_connector_meta(None) if admitted else None  # type: ignore[arg-type]

    def join_landed(self, scheduler_output: SchedulerOutput) -> list[NewRequestData]:
        """Add requests whose remote KV has landed to the step in flight, as one-token decodes.

        With ``handover_step="inflight"`` the engine core calls this between two decoder layers
        (after ``update_from_kv_transfers``); the runner then runs each joining request's missed
        layers alone and continues the batch with it (``ModelRunner.join_decodes``), so its
        first decode token comes with this step instead of the next one. The request becomes
        running exactly as ``schedule()`` would have made it in the next step, and is added to
        ``scheduler_output`` so ``update_from_output`` takes its token. Nothing joins a step
        that had to preempt, past a waiting request that is not waiting for remote KV (no
        overtaking), beyond ``max_num_seqs`` or the token budget, or when a request needs more
        than its last token computed (part of its KV failed to load: a prefill chunk, next step),
        nor when fewer blocks are free than requests run (each may need one for its next token).
        """
        config = self.scheduler_config
        if scheduler_output.preempted_req_ids or not self.finished_recving_kv_req_ids:
            return []
        joined: list[NewRequestData] = []
        for request in list(self.waiting):
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            if (
                scheduler_output.total_num_scheduled_tokens >= config.max_num_batched_tokens
                or len(self.running) >= config.max_num_seqs
            ):
                break
            req_id = request.request_id
            if req_id not in self.finished_recving_kv_req_ids:
                continue
            if self.pending_remote_tokens.get(req_id, 0) < request.num_tokens - 1:
                break  # schedule() admits it first (as a prefill chunk): nobody overtakes it
            if self.kv_cache_manager.num_free_blocks <= len(self.running):
                # Keep a block for each running request's next token: a join must not make the
                # next step preempt (its victim would be the joined request, recomputing).
                break
            self._remote_kv_ready(request)
            request.status = RequestStatus.WAITING  # as schedule() leaves it if blocks run out
            if self.kv_cache_manager.allocate_slots(request, 1) is None:
                break
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, block_ids, 0)
            self.waiting.remove_requests([request])
            self._start_running(request, request.num_computed_tokens)
            request.mark("joined_in_flight")
            joined.append(NewRequestData.from_request(request, block_ids))
            scheduler_output.scheduled_new_reqs.append(joined[-1])
            scheduler_output.num_scheduled_tokens[req_id] = 1
            scheduler_output.total_num_scheduled_tokens += 1
            request.num_computed_tokens += 1  # as schedule() advances what it schedules
        return joined

    def _start_running(self, request: Request, num_computed_tokens: int) -> None:
        """A waiting request admitted into a step (by ``schedule()`` or ``join_landed``)."""
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.mark("scheduled")
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens

    def _pick_preemption_victim(self) -> Request:
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the request's blocks and requeue it at the front."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.resync_req_ids.discard(request.request_id)  # it comes back as a new request anyway
        self.waiting.prepend_request(request)
        logger.debug("preempted %s", request.request_id)

    def _remote_kv_ready(self, request: Request) -> bool:
        """Move a request whose remote KV has landed back to schedulable, its tokens computed."""
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(request.request_id)
        num_computed = self.pending_remote_tokens.pop(request.request_id, 0)
        # The last token is always recomputed: its logits give the next token.
        num_computed = min(num_computed, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        return True

    # ------------------------------------------------------------------ step results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        num_scheduled = scheduler_output.num_scheduled_tokens
        sampled = model_runner_output.sampled_token_ids
        index_of = model_runner_output.req_id_to_index
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        # Before any token is taken: a token sampled over invalid KV must not be.
        rolled_back = (
            self._handle_invalid_blocks(model_runner_output.invalid_block_ids)
            if model_runner_output.invalid_block_ids
            else set()
        )
        new_running: list[Request] = []
        for request in self.running:
            req_id = request.request_id
            if num_scheduled.get(req_id, 0) == 0 or req_id in rolled_back:
                new_running.append(request)
                continue
            new_token_ids = list(sampled[index_of[req_id]]) if req_id in index_of else []
            stopped = False
            kv_transfer_params = None
            if new_token_ids and request.num_output_tokens == 0:
                request.mark("first_token")
            for count, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    stopped = True
                    del new_token_ids[count:]
                    request.mark("finished")
                    kv_transfer_params = self._free_request(request)
                    break
            if new_token_ids or kv_transfer_params:
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=request.get_finished_reason(),
                        kv_transfer_params=kv_transfer_params,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        num_prefix_hit_tokens=max(request.num_prefix_hit_tokens, 0),
                        timeline=request.take_timeline(),
                    )
                )
            if not stopped:
                new_running.append(request)
        self.running = new_running

        self.update_from_kv_transfers(
            model_runner_output.finished_sending, model_runner_output.finished_recving
        )
        for client_index, output in self.pending_outputs:
            outputs[client_index].append(output)
        self.pending_outputs = []

        result = {index: EngineCoreOutputs(outputs=outs) for index, outs in outputs.items()}
        if result and self.log_stats:
            next(iter(result.values())).scheduler_stats = self.make_stats()
        return result

    def update_from_kv_transfers(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        """Transfers the connector reports done: landed loads become schedulable, and blocks
        held for a transfer (an aborted load, a remote reader) are freed.

        Called with each step's results, and by the engine core in the middle of a step
        (before ``join_landed``): it touches no request of the step in flight.
        """
        for req_id in finished_recving or ():
            # Taken whatever became of the request, so the connector keeps nothing behind.
            events = self.connector.take_request_timeline(req_id) if self.connector is not None else {}
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.timeline.update(events)
            if request.is_finished():
                # Aborted while its blocks were being written: safe to free only now.
                self._free_blocks(request)
            else:
                request.mark("load_done")
                self.finished_recving_kv_req_ids.add(req_id)
        for req_id in finished_sending or ():
            request = self.requests.get(req_id)
            if request is not None and request.is_finished():
                self._free_blocks(request)

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """KV blocks the worker could not load (or loaded wrong). Every request holding one is
        affected: an asynchronous load still waiting, a synchronously loaded request that ran
        this step over the bad KV, and any request that shares the blocks through the prefix
        cache. Under ``recompute`` each rolls back to its first invalid block (a running one
        also drops the token sampled this step); under ``fail`` each ends with an error. The
        blocks leave the prefix cache either way. Returns the running requests rolled back.
        """
        fail = self.scheduler_config.kv_load_failure_policy == "fail"
        rolled_back: set[str] = set()
        for req_id, first_bad in self.kv_cache_manager.invalidate_blocks(invalid_block_ids).items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished and held for a remote reader: nothing will compute on them
            logger.warning(
                "%s: KV blocks invalid from block %d (%s)", req_id, first_bad, "fail" if fail else "recompute"
            )
            valid_tokens = first_bad * self.block_size
            if fail:
                self._fail_request(request, "kv_load_failed")
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                pending = self.pending_remote_tokens.get(req_id, 0)
                self.pending_remote_tokens[req_id] = min(pending, valid_tokens)
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                request.num_computed_tokens = min(request.num_computed_tokens, valid_tokens)
                self.resync_req_ids.add(req_id)
                rolled_back.add(req_id)
        return rolled_back

    def _fail_request(self, request: Request, stop_reason: str) -> None:
        """End a request with an error output (sent with this step's outputs) and free it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove_requests([request])
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = stop_reason
        self._free_request(request)
        self.pending_outputs.append(
            (
                request.client_index,
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                ),
            )
        )

    def _refuse_empty_async_load(self) -> bool:
        """A connector answered ``(0, True)``: an asynchronous load of nothing, which would park
        the request in WAITING_FOR_REMOTE_KVS with no load to finish it. It is a contract
        violation; the request is scheduled as if the answer were ``(0, False)``."""
        if not self._warned_empty_async_load:
            logger.warning(
                "%s.get_num_new_matched_tokens returned (0, True): nothing to load asynchronously; "
                "treating it as (0, False)",
                type(self.connector).__name__,
            )
            self._warned_empty_async_load = True
        return False

    # ------------------------------------------------------------------ introspection

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def num_held_blocks(self) -> int:
        return sum(self.kv_cache_manager.num_blocks_of(req_id) for req_id in self.held_req_ids)

    def make_stats(self) -> SchedulerStats | None:
        return self.snapshot() if self.log_stats else None

    def snapshot(self) -> SchedulerStats:
        """Current counts, whether or not per-step stats are on (the Stats RPC needs them)."""
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_for_remote_kvs=sum(
                1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ),
            num_held_blocks=self.num_held_blocks,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
        )

    def get_kv_connector(self) -> KVConnectorBase | None:
        return self.connector

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
