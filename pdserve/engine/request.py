"""A request's state as the scheduler sees it, and the sampling parameters it carries."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Finished statuses from here on (``is_finished`` relies on the order).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature=0`` (or below 1e-5, as in vLLM) is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Normalise so equal params compare equal and a list can't be mutated behind our back.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"stop_token_ids: {token!r} is not a token id of this vocabulary")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: it is greedy in all but name.
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int | None) -> None:
    """Raise ValueError naming ``prompt_token_ids`` for an empty, too long or out-of-vocab prompt."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids: the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt_token_ids: the prompt has {len(prompt_token_ids)} tokens, which leaves no room "
            f"to generate within max_model_len ({max_model_len})"
        )
    for token in prompt_token_ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (
            vocab_size is not None and token >= vocab_size
        ):
            raise ValueError(
                f"prompt_token_ids: {token!r} is outside the vocabulary [0, {vocab_size})"
            )


@dataclass
class Request:
    """One generation request: its tokens, progress, and where it is in the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    eos_token_id: int | None = None
    client_index: int = 0

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # Tokens found in the local prefix cache (or loaded remotely) at first scheduling; -1 = not yet.
    num_cached_tokens: int = field(default=-1, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    # Chained prefix-cache hashes of this request's full blocks, extended as tokens arrive.
    block_hashes: list = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        if self.arrival_time is None:
            self.arrival_time = time.time()

    # Requests are unique objects: identity hashing lets sets and queues hold them cheaply.
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)
