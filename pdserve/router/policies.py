"""How the router picks an engine among the healthy ones of a role.

``round_robin`` spreads evenly; ``least_loaded`` picks the fewest requests in flight (the
router's own exact count); ``prefix`` picks the engine that most recently saw the longest
prefix of this prompt (by chained block hashes, the same ones the engines' prefix caches
use), breaking ties by load.
"""

from __future__ import annotations

import collections
import itertools

from pdserve.router.engines import EngineHandle

POLICIES = ("round_robin", "least_loaded", "prefix")


class RoutingPolicy:
    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        # One count per role: with a shared one, a 1P2D router's decode picks would all land
        # on the same engine (every request takes one prefill pick, then one decode pick).
        self._counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)

    def pick(self, engines: list[EngineHandle], block_hashes: list) -> EngineHandle:
        """One of ``engines`` (non-empty) for a prompt whose block hashes are given."""
        if self.name == "round_robin":
            return engines[next(self._counters[engines[0].role]) % len(engines)]
        if self.name == "least_loaded":
            return min(engines, key=lambda e: e.in_flight)
        return max(engines, key=lambda e: (e.cached_prefix_blocks(block_hashes), -e.in_flight))
