"""Paged KV cache bookkeeping: a block pool with prefix caching, and the per-request manager.

Only ids and counters live here; the tensors are the runner's. Every hot-path operation is O(1)
per block: the free queue is a doubly linked list and cached blocks are found by hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.engine.request import Request


class BlockHash(NamedTuple):
    """A block's prefix-cache key: the chained hash and the block's own tokens.

    Keeping the token ids in the key means two different blocks can only collide if both the
    64-bit chain hash of every earlier block and this block's tokens match.
    """

    hash_value: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Iterable[int]) -> BlockHash:
    """Chain ``parent``'s hash with this block's tokens (ints hash the same in every process)."""
    tokens = tuple(token_ids)
    parent_value = parent.hash_value if parent is not None else 0
    return BlockHash(hash((parent_value, tokens)), tokens)


def hash_request_blocks(token_ids: list[int], block_size: int, hashes: list[BlockHash]) -> list[BlockHash]:
    """Extend ``hashes`` (in place) to cover every full block of ``token_ids``; returns it."""
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class KVCacheBlock:
    """One block's metadata. A block with ``ref_cnt == 0`` is in the free queue."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache; must be None before it is cached again.
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first.

    A doubly linked list between two sentinels, so taking a cached block back out of the middle
    (a prefix-cache hit on a free block) is O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks: reference counts, the free queue, and the prefix-cache index.

    A cached block (one with a hash) may be in use (``ref_cnt > 0``) or an eviction candidate
    in the free queue; it leaves the cache only when it is reused for new content.

    With events on (``enable_events``), every change to the set of cached hashes is recorded
    for the KV-event publisher: ``BlockStored`` when a hash enters the index (its first block),
    ``BlockRemoved`` when it leaves (its last block), ``AllBlocksCleared`` on a reset. Since
    blocks are not de-duplicated, a hash cached twice is reported once: a subscriber's index
    is a set of hashes, and it is exact.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # {block_hash: {block_id: block}}: blocks are not de-duplicated, so block tables stay
        # append-only even when two requests computed the same block concurrently.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # Events since the last take_events(); None while events are off (nothing recorded).
        self.pending_events: list[KVCacheEvent] | None = None
        # {block_hash: parent's hash value}, while events are on: snapshots need the parents.
        self._parents: dict[BlockHash, int | None] = {}

    def enable_events(self) -> None:
        """Start recording KV events; the first one says the cache starts empty."""
        self.pending_events = [AllBlocksCleared(), *self.snapshot_events()[1:]]

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (the engine publishes them once per step)."""
        if not self.pending_events:
            return []
        events, self.pending_events = self.pending_events, []
        return events

    def snapshot_events(self) -> list[KVCacheEvent]:
        """``AllBlocksCleared`` plus one ``BlockStored`` per cached hash: the whole index, for a
        subscriber whose replay no longer reaches back far enough."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for block_hash in self.cached_block_hash_to_block:
            events.append(
                BlockStored(
                    [block_hash.hash_value],
                    self._parents.get(block_hash),
                    list(block_hash.token_ids),
                    len(block_hash.token_ids),
                )
            )
        return events

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.num_free_blocks} left")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.uncache(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def uncache(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the prefix-cache index (reused for new content, or its content
        turned out wrong); a no-op for an uncached block."""
        if block.block_hash is None:
            return
        same_hash = self.cached_block_hash_to_block.get(block.block_hash)
        if same_hash is not None:
            same_hash.pop(block.block_id, None)
            if not same_hash:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.pending_events is not None:
                    self._parents.pop(block.block_hash, None)
                    self.pending_events.append(BlockRemoved([block.block_hash.hash_value]))
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching zero join the queue in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Index ``blocks[start:end]`` under ``block_hashes[start:end]``."""
        new_run: list[int] = []  # indices of hashes new to the index, in a consecutive run
        for i in range(start, end):
            block = blocks[i]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hashes[i]
            same_hash = self.cached_block_hash_to_block.setdefault(block.block_hash, {})
            is_new = not same_hash
            same_hash[block.block_id] = block
            if self.pending_events is None:
                continue
            if is_new:
                self._parents[block.block_hash] = block_hashes[i - 1].hash_value if i > 0 else None
                if new_run and new_run[-1] != i - 1:
                    self._record_stored(block_hashes, new_run)
                    new_run = []
                new_run.append(i)
        if new_run:
            self._record_stored(block_hashes, new_run)

    def _record_stored(self, block_hashes: list[BlockHash], run: list[int]) -> None:
        assert self.pending_events is not None
        first = run[0]
        self.pending_events.append(
            BlockStored(
                [block_hashes[i].hash_value for i in run],
                block_hashes[first - 1].hash_value if first > 0 else None,
                [t for i in run for t in block_hashes[i].token_ids],
                len(block_hashes[first].token_ids),
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.pending_events is not None:
            self._parents.clear()
            self.pending_events.append(AllBlocksCleared())
        return True

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request (cached but free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class PrefixCacheStats:
    """Cumulative since start (Prometheus-counter style), so no reader steals another's counts."""

    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


class KVCacheManager:
    """Which blocks each request holds, and how many of them are in the prefix cache."""

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # {req_id: block table}
        self.num_cached_blocks: dict[str, int] = {}  # {req_id: leading blocks already indexed}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request`` in whole blocks, and its token count.

        The last token is never taken from the cache: its logits must be computed.
        """
        if not self.enable_caching:
            return [], 0
        hashes = hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        max_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup. The scheduler calls this once a request is admitted,
        not per lookup: a request that waits for blocks is looked up again every step."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits (``num_new_computed_tokens`` tokens) taken
        over by the request. Returns the ids of newly allocated blocks, or None (and changes
        nothing) when the pool cannot supply them. ``delay_cache_blocks`` keeps the blocks out of
        the prefix cache until their content has arrived (remote KV loads).
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        assert not (new_computed_blocks and req_blocks), "cache hits go at the start of a block table"
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        num_required_blocks = -(-num_tokens_need_slot // self.block_size)
        num_new_blocks = num_required_blocks - len(req_blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue are counted as free but cannot be handed out twice.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full blocks whose tokens are known, up to ``num_computed_tokens``."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        # After an invalidation, a block shared with another request (a prefix hit) may already
        # have been re-indexed by that request when it recomputed it first.
        while start < num_full and blocks[start].block_hash == hashes[start]:
            start += 1
        self.block_pool.cache_full_blocks(blocks, hashes, start, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    def invalidate_blocks(self, invalid_block_ids: set[int]) -> dict[str, int]:
        """Blocks whose content is wrong (a failed KV load) leave the prefix cache, and so does
        every later block of a request holding one (computed over them): no request can hit
        them any more. Returns {req_id: index of its first invalid block} for every request
        holding one; each re-indexes its blocks from there as it recomputes them."""
        affected: dict[str, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            first = next((i for i, block in enumerate(blocks) if block.block_id in invalid_block_ids), None)
            if first is None:
                continue
            affected[req_id] = first
            for block in blocks[first:]:
                self.block_pool.uncache(block)
            self.num_cached_blocks[req_id] = min(self.num_cached_blocks.get(req_id, 0), first)
        for block_id in invalid_block_ids:  # also those no request holds any more
            if 0 <= block_id < len(self.block_pool.blocks):
                self.block_pool.uncache(self.block_pool.blocks[block_id])
        return affected

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a prefix's tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
