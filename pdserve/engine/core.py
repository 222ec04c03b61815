"""EngineCore: the busy loop that owns a scheduler and a runner (schedule -> execute -> update).

Both engine roles run this same loop; only the connector differs. In a server the loop runs in
its own process and blocks on its input channel when there is nothing to do, so an idle engine
uses no CPU; ``pdserve.LLM`` drives ``step()`` directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.connector.base import KVConnectorBase
from pdserve.engine.cpu_lending import LentThreads
from pdserve.engine.kv_events import EventBatch, KVEventPublisher
from pdserve.engine.model.loader import LoadedModel
from pdserve.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pdserve.engine.request import Request, RequestStatus, SamplingParams, validate_prompt
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import Scheduler

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# While requests wait on remote KV (or blocks are held for a remote reader) there is no model
# work, but the connector must still be polled: this is how often, instead of spinning.
CONNECTOR_POLL_INTERVAL_S = 0.0005
# With nothing but held blocks (leases) outstanding, how often the connector is polled.
HELD_BLOCKS_POLL_INTERVAL_S = 0.02
# An idle core wakes this often to check its stop flag; otherwise it sleeps on its input.
IDLE_WAKEUP_S = 0.5
# During a forward pass the core looks at its input every this many decoder layers, so a
# decode request arriving mid-step starts its KV pull within a layer (3-6 ms of a bundled-model
# decode step; every 4 layers was 10 ms on average under load) instead of at the next step.
# A look is one non-blocking socket poll (~10 us).
LAYERS_PER_INPUT_POLL = 1
# With handover_step="inflight", a request whose KV has landed joins the step in flight only
# while at most this share of the decoder layers has run: its missed layers run alone first,
# and a one-row layer costs about 2/3 of a batch layer here (the weights dominate), so a late
# join would cost the running requests more than the next step costs the joining one.
INFLIGHT_JOIN_MAX_LAYER_FRACTION = 0.5


@dataclass
class EngineCoreRequest:
    """A validated request as it crosses into the engine core (from the front or the LLM)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class AbortRequests:
    request_ids: list[str] = field(default_factory=list)


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorBase | None = None,
        kv_cache_dtype: str | torch.dtype = "float32",
        log_stats: bool = True,
    ) -> None:
        self.loaded = loaded
        self.vocab_size = loaded.arch.vocab_size
        self.eos_token_id = loaded.tokenizer.eos_token_id
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_spec = loaded.arch.kv_cache_spec(cache_config.block_size, kv_cache_dtype)
        self.runner = ModelRunner(loaded.model, self.kv_cache_spec, cache_config.num_blocks, connector)
        self.scheduler = Scheduler(scheduler_config, cache_config, connector, log_stats=log_stats)
        self.connector = connector
        self.last_step_num_tokens = 0
        self._stepping = False  # inside step(): inputs other than new requests wait for its end
        self._deferred_inputs: list[Any] = []  # taken in mid-step, handled after the step
        self._step_output: SchedulerOutput | None = None  # the step in flight
        # Transfers polled mid-step that the step's end must handle (a failed load among them):
        # (finished_sending, finished_recving, invalid_block_ids), merged into the next update.
        self._carried_transfers: tuple[set[str], set[str], set[int]] | None = None
        self.joins_in_flight = scheduler_config.handover_step == "inflight" and connector is not None
        self._max_join_layer = int(self.runner.num_layers * INFLIGHT_JOIN_MAX_LAYER_FRACTION)
        self.num_joined_in_flight = 0  # requests that joined a step in flight (a counter)
        self.kv_events: KVEventPublisher | None = None
        # Cores lent by the other engines of the machine while they are idle (pdserve cluster):
        # the busy loop marks this engine busy or idle and sizes each step's threads.
        self.lent_threads: LentThreads | None = None

    def attach_kv_events(self, publisher: KVEventPublisher) -> None:
        """Publish this engine's KV-cache events: one batch per step that changed the cache."""
        self.kv_events = publisher
        self.scheduler.kv_cache_manager.block_pool.enable_events()
        self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """Send what the block pool recorded since the last call as one batch (one sequence
        number), and a snapshot of the whole cache after it if a subscriber asked for one."""
        if self.kv_events is None:
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        events = pool.take_events()
        if self.kv_events.snapshot_wanted.is_set():
            self.kv_events.snapshot_wanted.clear()
            events += pool.snapshot_events()
        if events:
            self.kv_events.publish(EventBatch(time.time(), events))

    # ------------------------------------------------------------------ inputs

    def validate(self, request: EngineCoreRequest) -> None:
        """Raise ValueError (naming the field) before anything is queued."""
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError("request_id must be a non-empty string")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        validate_prompt(
            request.prompt_token_ids,
            self.scheduler_config.max_model_len,
            self.vocab_size,
            request.sampling_params.num_prior_output_tokens,
        )
        request.sampling_params.validate(self.vocab_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate(request)
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                kv_transfer_params=request.kv_transfer_params,
                eos_token_id=self.eos_token_id,
            )
        )

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort: free (or release) every block the requests hold. One output answers each id
        (``answers_abort``): the "abort" output of a request still running, an empty unfinished
        one otherwise (finished, held for a remote reader, or unknown)."""
        request_ids = list(request_ids)
        requests = self.scheduler.requests
        unfinished = {rid for rid in request_ids if rid in requests and not requests[rid].is_finished()}
        self.scheduler.finish_requests(
            [rid for rid in request_ids if rid in requests], RequestStatus.FINISHED_ABORTED
        )
        outputs = []
        for rid in request_ids:
            finish_reason = "abort" if rid in unfinished else None
            unfinished.discard(rid)  # an id given twice: its second answer is the empty one
            outputs.append(EngineCoreOutput(rid, [], finish_reason=finish_reason, answers_abort=True))
        return outputs

    # ------------------------------------------------------------------ the loop

    def has_work(self) -> bool:
        """Model work to do, or connector state (loads, held blocks) that needs polling."""
        scheduler = self.scheduler
        return scheduler.has_requests() or bool(scheduler.held_req_ids)

    def admit_remote_loads(self) -> None:
        """Start the KV pulls of newly arrived remote-prefill requests now (mid-step)."""
        metadata = self.scheduler.admit_remote_loads()
        if metadata is not None and self.connector is not None:
            self.connector.start_load_kv(metadata)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if self.lent_threads is not None:
            # Busy only while a step computes: a step of no tokens (transfers in flight) lends.
            if self.last_step_num_tokens:
                self.lent_threads.begin_step()
            else:
                self.lent_threads.idle()
        self._step_output = scheduler_output
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as exc:  # one bad batch must not take the engine (and every request) down
            # (Requests that joined the step mid-pass are in num_scheduled_tokens too.)
            failed = self._fail_step(list(scheduler_output.num_scheduled_tokens), exc)
            if self._carried_transfers is None:
                return failed
            # Transfers polled mid-step are handled now, not a step later: the connector has
            # forgotten those loads, so an abort meanwhile would free blocks that a carried
            # failed load would then invalidate under their next owner.
            runner_output = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
            self._merge_carried_transfers(runner_output)
            per_client = self.scheduler.update_from_output(scheduler_output, runner_output)
            return failed + [output for outs in per_client.values() for output in outs.outputs]
        finally:
            self._step_output = None
        if self._carried_transfers is not None:
            self._merge_carried_transfers(runner_output)
        per_client = self.scheduler.update_from_output(scheduler_output, runner_output)
        return [output for outs in per_client.values() for output in outs.outputs]

    def _merge_carried_transfers(self, runner_output: ModelRunnerOutput) -> None:
        assert self._carried_transfers is not None
        sending, recving, invalid = self._carried_transfers
        self._carried_transfers = None
        runner_output.finished_sending = (runner_output.finished_sending or set()) | sending or None
        runner_output.finished_recving = (runner_output.finished_recving or set()) | recving or None
        runner_output.invalid_block_ids = (runner_output.invalid_block_ids or set()) | invalid or None

    def _join_landed_requests(self) -> None:
        """Mid-step: take the transfers that finished, and let landed requests join the step.

        A failed load (invalid blocks) may roll back running requests, which only the step's
        end can do: then everything polled is carried to it and nothing joins this step.
        """
        assert self.connector is not None and self._step_output is not None
        if self._carried_transfers is not None:
            return
        sending, recving = self.connector.get_finished(set())
        invalid = self.connector.get_invalid_block_ids()
        if invalid:
            self._carried_transfers = (sending or set(), recving or set(), invalid)
            return
        if sending or recving:
            self.scheduler.update_from_kv_transfers(sending, recving)
        joined = self.scheduler.join_landed(self._step_output)
        if joined:
            self.runner.join_decodes(joined)
            self.num_joined_in_flight += len(joined)
            logger.debug("joined the step in flight: %s", [new.req_id for new in joined])

    def _fail_step(self, request_ids: list[str], exc: Exception) -> list[EngineCoreOutput]:
        logger.exception("model step failed; failing its %d requests: %s", len(request_ids), request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        reason = f"internal error: {type(exc).__name__}: {exc}"
        return [
            EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error", stop_reason=reason)
            for rid in request_ids
        ]

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.snapshot()
        if self.connector is not None:
            stats.kv_connector = self.connector.stats()
        return stats

    def run_busy_loop(
        self,
        receive: Callable[[float | None], list[Any]],
        emit: Callable[[list[EngineCoreOutput]], None],
        should_stop: Callable[[], bool],
    ) -> None:
        """Serve until ``should_stop()``: block in ``receive`` when idle, step while there is work.

        ``receive(timeout)`` returns the inputs that arrived (waiting up to ``timeout`` seconds,
        forever for None): ``EngineCoreRequest`` and ``AbortRequests``. Invalid requests are
        answered with an ``error`` output and never reach the scheduler.

        With a KV connector, new requests are also taken in between decoder layers while a
        step runs, and remote-prefill ones get their blocks and start their pulls at once
        (``admit_remote_loads``); aborts taken in then are handled right after the step, since
        the step in flight may be computing the very request.
        """
        remove_hook = (
            self.runner.call_between_layers(
                lambda layer_index: self._between_layers(receive, emit, layer_index), LAYERS_PER_INPUT_POLL
            )
            if self.connector is not None
            else None
        )
        try:
            self._serve(receive, emit, should_stop)
        finally:
            if remove_hook is not None:
                remove_hook()

    def _serve(
        self,
        receive: Callable[[float | None], list[Any]],
        emit: Callable[[list[EngineCoreOutput]], None],
        should_stop: Callable[[], bool],
    ) -> None:
        while not should_stop():
            if self._deferred_inputs or self.scheduler.has_requests():
                timeout = 0.0
            elif self.has_work():
                timeout = HELD_BLOCKS_POLL_INTERVAL_S  # only leases to watch
            else:
                timeout = IDLE_WAKEUP_S  # idle: sleep on the input channel
            deferred, self._deferred_inputs = self._deferred_inputs, []
            for item in deferred + receive(timeout):
                self._handle_input(item, emit)
            lent = self.lent_threads
            if not self.has_work():
                if lent is not None:
                    lent.idle()
                self.publish_kv_events()  # an abort or a reset changed the cache; or a snapshot
                continue
            self._stepping = True
            try:
                outputs = self.step()
            finally:
                self._stepping = False
            if lent is not None and not self.scheduler.has_requests():
                # The last request finished: lend the cores while waiting for input (a step of
                # no tokens, only KV pulls in flight, marked itself idle in step()).
                lent.idle()
            self.publish_kv_events()
            if outputs:
                emit(outputs)
            if self.last_step_num_tokens == 0 and self.scheduler.has_requests():
                time.sleep(CONNECTOR_POLL_INTERVAL_S)  # only transfers in flight: don't spin

    def _between_layers(
        self,
        receive: Callable[[float | None], list[Any]],
        emit: Callable[[list[EngineCoreOutput]], None],
        layer_index: int,
    ) -> None:
        if not self._stepping:
            return  # a forward outside the busy loop's step (warm-up): nothing to take
        if self.lent_threads is not None:
            self.lent_threads.apply()  # an owner that became busy takes its cores back now
        self._take_inputs_mid_step(receive, emit)
        if self.joins_in_flight and layer_index <= self._max_join_layer:
            self._join_landed_requests()

    def _take_inputs_mid_step(
        self, receive: Callable[[float | None], list[Any]], emit: Callable[[list[EngineCoreOutput]], None]
    ) -> None:
        added = False
        for item in receive(0.0):
            if isinstance(item, EngineCoreRequest) and not self._deferred_inputs:
                self._handle_input(item, emit)
                added = True
            else:
                # Inputs are handled in the order sent: a request that follows a deferred abort
                # waits with it (it may reuse the aborted id).
                self._deferred_inputs.append(item)
        if added:
            self.admit_remote_loads()

    def _handle_input(self, item: Any, emit: Callable[[list[EngineCoreOutput]], None]) -> None:
        if isinstance(item, AbortRequests):
            outputs = self.abort_requests(item.request_ids)
            if outputs:
                emit(outputs)
            return
        try:
            self.add_request(item)
        except ValueError as exc:
            logger.info("rejected request %s: %s", item.request_id, exc)
            emit(
                [
                    EngineCoreOutput(
                        request_id=item.request_id,
                        new_token_ids=[],
                        finish_reason="error",
                        stop_reason=str(exc),
                    )
                ]
            )

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
