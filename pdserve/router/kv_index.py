"""The router's exact index of which engine's prefix cache holds which block, and the blocks
it has just sent engines to store.

``KVBlockIndex`` is fed by the engines' KV-cache events (``pdserve.router.kv_subscriber``);
keyed by the chained block hash that both the engines and the router compute
(``hash_request_blocks``), so a prompt is matched without tokenizing twice: the router hashes
its token ids once, and every engine's longest cached prefix is a walk down that list.

``PendingBlocks`` covers what events cannot yet say: a prompt the router has just routed to an
engine will be stored there, but its ``BlockStored`` comes only once the engine has scheduled
it. Without it, a second request of the same prefix routed in that window sees no engine
holding the prefix, goes by load, and often lands on the other engine, which then computes
(and caches, and later evicts for) the same prefix a second time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# A routed prompt's blocks count as on their way to its engine for this long at most, should
# their BlockStored never come (the request failed or was aborted before it was scheduled).
PENDING_TTL_S = 10.0


class KVBlockIndex:
    """Invariant: ``engines_of[h]`` holds ``e`` exactly when ``hashes_of[e]`` holds ``h``, and
    neither keeps an empty set."""

    def __init__(self) -> None:
        self.engines_of: dict[int, set[str]] = {}  # {block hash: engines holding it}
        self.hashes_of: dict[str, set[int]] = {}  # {engine: block hashes it holds}

    def store(self, engine: str, block_hashes: Iterable[int]) -> None:
        held = self.hashes_of.setdefault(engine, set())
        for block_hash in block_hashes:
            held.add(block_hash)
            self.engines_of.setdefault(block_hash, set()).add(engine)

    def remove(self, engine: str, block_hashes: Iterable[int]) -> None:
        held = self.hashes_of.get(engine)
        if held is None:
            return
        for block_hash in block_hashes:
            held.discard(block_hash)
            holders = self.engines_of.get(block_hash)
            if holders is not None:
                holders.discard(engine)
                if not holders:
                    del self.engines_of[block_hash]
        if not held:
            del self.hashes_of[engine]

    def clear(self, engine: str) -> None:
        """Forget everything ``engine`` holds (it cleared its cache, restarted, or left)."""
        self.remove(engine, list(self.hashes_of.get(engine, ())))

    def matched_blocks(self, engine: str, block_hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) ``engine`` holds: what its
        prefix cache will hit (a cache hit must be a prefix)."""
        held = self.hashes_of.get(engine)
        if not held:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def num_blocks(self, engine: str) -> int:
        return len(self.hashes_of.get(engine, ()))

    def __len__(self) -> int:
        return len(self.engines_of)


class PendingBlocks:
    """Blocks of prompts routed to an engine whose ``BlockStored`` has not arrived yet.

    Invariant: an entry leaves when its engine's ``BlockStored`` for that hash is applied (the
    index holds it from then on), when its engine's entries are dropped, or ``ttl`` seconds
    after the last request routed with it; no engine keeps an empty dict.
    """

    def __init__(self, ttl: float = PENDING_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self.expiry_of: dict[str, dict[int, float]] = {}  # {engine: {block hash: expiry time}}
        self._next_purge = 0.0

    def add(self, engine: str, block_hashes: Iterable[int]) -> None:
        now = self.clock()
        if now >= self._next_purge:
            # Entries a lookup never reaches are dropped here, once per ttl: O(pending) each time.
            self._next_purge = now + self.ttl
            for name in list(self.expiry_of):
                self._drop(name, [h for h, expiry in self.expiry_of[name].items() if expiry <= now])
        expiry = now + self.ttl
        pending = self.expiry_of.setdefault(engine, {})
        for block_hash in block_hashes:
            pending[block_hash] = expiry
        if not pending:
            del self.expiry_of[engine]

    def stored(self, engine: str, block_hashes: Iterable[int]) -> None:
        """``engine``'s BlockStored for these arrived: the index holds them from now on."""
        self._drop(engine, block_hashes)

    def _drop(self, engine: str, block_hashes: Iterable[int]) -> None:
        pending = self.expiry_of.get(engine)
        if pending is None:
            return
        for block_hash in block_hashes:
            pending.pop(block_hash, None)
        if not pending:
            del self.expiry_of[engine]

    def clear(self, engine: str) -> None:
        self.expiry_of.pop(engine, None)

    def holds(self, engine: str, block_hash: int) -> bool:
        """True while ``block_hash`` is on its way to ``engine`` (an expired entry is dropped)."""
        pending = self.expiry_of.get(engine)
        if pending is None:
            return False
        expiry = pending.get(block_hash)
        if expiry is None:
            return False
        if expiry <= self.clock():
            self._drop(engine, [block_hash])
            return False
        return True

    def num_blocks(self, engine: str) -> int:
        return len(self.expiry_of.get(engine, ()))
