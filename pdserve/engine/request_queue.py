"""Waiting queues: FIFO for ``fcfs``, a heap on ``(priority, arrival_time)`` for ``priority``."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pdserve.engine.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back so it is considered first (policy permitting)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in reversed(list(requests)):
            self.prepend_request(request)

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._queue = deque(r for r in self._queue if r not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


@dataclass(order=True, slots=True)
class _HeapEntry:
    """Ordered by ``(priority, arrival_time, seq)``; ``seq`` is unique, so requests are never compared."""

    priority: int
    arrival_time: float
    seq: int
    request: Request = field(compare=False)


class PriorityRequestQueue(RequestQueue):
    """Lower ``priority`` value first, then earlier arrival; re-adding keeps that order."""

    def __init__(self) -> None:
        self._heap: list[_HeapEntry] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        assert request.arrival_time is not None  # Request.__post_init__ sets it
        heapq.heappush(
            self._heap, _HeapEntry(request.priority, request.arrival_time, next(self._counter), request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap).request

    def peek_request(self) -> Request:
        return self._heap[0].request

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._heap = [entry for entry in self._heap if entry.request not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry.request for entry in sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
