"""Plain data passed between scheduler, runner and engine front (vLLM v1's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.request import Request, SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner needs the first time it sees a request."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens already generated (non-empty when a preempted request is rescheduled from scratch).
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None  # min_tokens masks it

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            eos_token_id=request.eos_token_id,
        )


@dataclass
class CachedRequestData:
    """Per-step deltas for requests the runner already holds (running or resumed)."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and ``new_block_ids`` replaces its whole block table.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's decisions: which requests run, how many tokens each, with which blocks."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # {req_id: tokens to compute this step}
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, plus the connector's finished transfers."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]  # one list per request; empty while still prefilling
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] | None = None


@dataclass
class EngineCoreOutput:
    """New tokens (and, once finished, why) for one request in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # of the prompt, found in this engine's prefix cache
    # {event: unix time} of the request's life-cycle events since its previous output.
    timeline: dict[str, float] | None = None
    # The core's answer to one id of an Abort: the request's "abort" output if it was running,
    # else an empty unfinished one. Nothing of the request it aborted follows it, so a front can
    # tell that request's late outputs from those of a new request reusing the id.
    answers_abort: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: set[str] | None = None
    scheduler_stats: Any = None


@dataclass
class SchedulerStats:
    """A snapshot for logs, metrics and the ``Stats`` RPC."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_held_blocks: int = 0  # blocks of finished requests kept for a remote reader
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    kv_connector: dict = field(default_factory=dict)  # the connector's own counters
    # Counted by the core process over its life (``core_proc.OutputCounts``): every request's.
    num_generated_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)  # {finish_reason: requests}


@dataclass
class Completion:
    """A finished generation as users see it (``LLM.generate`` and the gRPC client)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
