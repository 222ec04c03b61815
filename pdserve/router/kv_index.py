"""The router's exact index of which engine's prefix cache holds which block.

Fed by the engines' KV-cache events (``pdserve.router.kv_subscriber``); keyed by the chained
block hash that both the engines and the router compute (``hash_request_blocks``), so a prompt
is matched without tokenizing twice: the router hashes its token ids once, and every engine's
longest cached prefix is a walk down that list.
"""

from __future__ import annotations

from collections.abc import Iterable


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
