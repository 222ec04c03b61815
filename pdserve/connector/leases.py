"""The lease table: blocks a prefill engine holds for remote readers, and until when.

A finished prefill request's blocks stay allocated until the decode engine says it has read
them (release), its lease runs out (the reader died or stalled), or the request is aborted.
The side-channel thread renews and releases; the engine thread adds and collects what is
done, hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    block_ids: list[int]
    expires_at: float


class LeaseTable:
    def __init__(self, default_lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_lease_s = default_lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # {req_id: lease}
        self._done: set[str] = set()  # released or expired, not yet reported to the scheduler
        self.num_expired = 0
        self.num_released = 0

    def add(self, req_id: str, block_ids: list[int], lease_s: float | None = None) -> None:
        with self._lock:
            self._leases[req_id] = Lease(list(block_ids), self.clock() + (lease_s or self.default_lease_s))

    def renew(self, req_id: str, lease_s: float | None = None) -> bool:
        """Push a lease's expiry out (the reader is still working); False if unknown."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None:
                return False
            lease.expires_at = self.clock() + (lease_s or self.default_lease_s)
            return True

    def release(self, req_id: str) -> bool:
        """The reader is done: the blocks may be freed at the next poll. False if unknown."""
        with self._lock:
            if self._leases.pop(req_id, None) is None:
                return False
            self._done.add(req_id)
            self.num_released += 1
            return True

    def drop(self, req_id: str) -> None:
        """Forget a lease whose blocks the scheduler already freed (abort); nothing to report."""
        with self._lock:
            self._leases.pop(req_id, None)
            self._done.discard(req_id)

    def take_done(self) -> set[str]:
        """Released and expired request ids since the last call (the scheduler frees them)."""
        now = self.clock()
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
            for rid in expired:
                del self._leases[rid]
            self.num_expired += len(expired)
            done, self._done = self._done | set(expired), set()
            return done

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, req_id: object) -> bool:
        with self._lock:
            return req_id in self._leases
