"""The scheduler's contract (vLLM v1's ``SchedulerInterface``): decide, never execute."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.connector.base import KVConnectorBase
    from pdserve.engine.outputs import (
        EngineCoreOutputs,
        ModelRunnerOutput,
        SchedulerOutput,
        SchedulerStats,
    )
    from pdserve.engine.request import Request, RequestStatus


class SchedulerInterface(ABC):
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next step and allocate their KV blocks.

        Advances each scheduled request's ``num_computed_tokens`` by what it scheduled, so the
        next ``schedule()`` can continue a chunked prefill before this step's output arrives.
        """

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply one step's sampled tokens: append, check stops, free finished requests."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """True if requests finished since the last ``schedule()`` (the runner must be told)."""

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones not yet reported in a SchedulerOutput."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running_reqs, num_waiting_reqs)``."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; True only when no block is in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None:
        """A stats snapshot when ``log_stats`` is on, else None."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the scheduler owns."""

    def get_kv_connector(self) -> KVConnectorBase | None:
        return None
