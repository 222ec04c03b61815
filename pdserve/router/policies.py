"""How the router picks an engine among the healthy ones of a role.

``round_robin`` spreads evenly; ``least_loaded`` picks the fewest requests in flight (the
router's own exact count); ``prefix`` picks the engine that most recently saw the longest
prefix of this prompt (by chained block hashes, the same ones the engines' prefix caches
use), breaking ties by load: a guess, blind to evictions and restarts.

``kv`` (the default) routes on what each engine really holds, from the KV-cache events the
engines publish (``kv_subscriber``). For a prompt of block hashes ``h`` and an engine ``e``,

    score(e) = matched(e, h) - load_weight * in_flight(e)

where ``matched`` is how many leading blocks of ``h`` ``e`` holds, or will hold: in the index
(its events say it has them), or pending (a prompt with them was just routed to ``e`` and its
``BlockStored`` has not arrived yet; ``PendingBlocks``). For a prefill engine these are the
blocks it need not compute, for a decode engine the blocks it need not pull from prefill.
Counting pending blocks sends concurrent requests of one new prefix to the engine already
computing it, instead of by load to another that would compute (and cache) it again.
``in_flight`` is the router's count of requests running on ``e``, and
``load_weight`` (``--kv-load-weight``, default 4) is how many cached blocks one more request
in flight is worth. The highest score wins; ties go to the less loaded engine, then in turn.
Until every candidate's index is in sync (events off, an engine just started or resyncing),
``kv`` picks as ``prefix`` does.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any

from pdserve.router.engines import EngineHandle

if TYPE_CHECKING:
    from pdserve.router.kv_subscriber import KVEventTracker

POLICIES = ("round_robin", "least_loaded", "prefix", "kv")
DEFAULT_KV_LOAD_WEIGHT = 4.0


def hash_values(block_hashes: list[Any]) -> list[int]:
    """Chained block hashes as the ints the engines publish (``BlockHash.hash_value``)."""
    return [getattr(h, "hash_value", h) for h in block_hashes]


class RoutingPolicy:
    def __init__(
        self,
        name: str,
        kv_events: KVEventTracker | None = None,
        load_weight: float = DEFAULT_KV_LOAD_WEIGHT,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        if load_weight < 0:
            raise ValueError(f"kv load weight must be >= 0, got {load_weight}")
        self.name = name
        self.kv_events = kv_events
        self.load_weight = load_weight
        # One count per role: with a shared one, a 1P2D router's decode picks would all land
        # on the same engine (every request takes one prefill pick, then one decode pick).
        self._counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)

    def uses_index(self, engines: list[EngineHandle]) -> bool:
        """True when ``kv`` can route on exact data: every candidate's index is in sync."""
        return (
            self.name == "kv"
            and self.kv_events is not None
            and all(self.kv_events.in_sync(e.address) for e in engines)
        )

    def pick(self, engines: list[EngineHandle], block_hashes: list) -> EngineHandle:
        """One of ``engines`` (non-empty) for a prompt whose block hashes are given."""
        if self.name == "round_robin":
            return engines[next(self._counters[engines[0].role]) % len(engines)]
        if self.name == "least_loaded":
            return min(engines, key=lambda e: e.in_flight)
        if self.uses_index(engines):
            assert self.kv_events is not None
            values = hash_values(block_hashes)
            start = next(self._counters[engines[0].role]) % len(engines)
            rotated = engines[start:] + engines[:start]
            return max(
                rotated,
                key=lambda e: (
                    self.kv_events.matched_blocks(e.address, values) - self.load_weight * e.in_flight,  # type: ignore[union-attr]
                    -e.in_flight,
                ),
            )
        return max(engines, key=lambda e: (e.cached_prefix_blocks(block_hashes), -e.in_flight))

    def routed(self, engine: EngineHandle, block_hashes: list) -> None:
        """A prompt was just sent to ``engine``: under ``kv``, its blocks count as held there
        from now on (pending until the engine's BlockStored for them arrives)."""
        if self.name == "kv" and self.kv_events is not None:
            self.kv_events.routed(engine.address, hash_values(block_hashes))

    def expected_blocks(self, engine: EngineHandle, block_hashes: list) -> int:
        """Leading prompt blocks the router expects ``engine``'s prefix cache to hold: the
        index's count when in sync, else the ``prefix`` guess."""
        if self.kv_events is not None and self.kv_events.in_sync(engine.address):
            return self.kv_events.matched_blocks(engine.address, hash_values(block_hashes))
        return engine.cached_prefix_blocks(block_hashes)
