"""The router's subscription to each engine's KV-cache events, kept exact in ``KVBlockIndex``.

One ``EngineEventStream`` per engine that advertises an event port in its Info (static or
found through ``dns:``). It reads the engine's PUB socket and applies each batch in sequence
order. Its states:

- **catching up**: on start it replays from sequence 0 (the engine's first batch says
  ``AllBlocksCleared``), so a router that starts after its engines still knows everything the
  replay buffer holds;
- **in sync**: every batch up to ``expected - 1`` applied. A batch arriving with a higher
  sequence number (one was lost) makes it replay from ``expected`` first; so does a quiet
  spell of ``IDLE_CHECK_S`` (the last batch before a silence may be the lost one);
- **resyncing**: the replay no longer reaches back to ``expected``: the engine's entries are
  dropped, the replayed batches applied, and the engine (asked for too old a sequence number)
  opens its next batch with ``AllBlocksCleared`` plus every block it holds. Applying that makes
  the stream in sync again; until then the router routes it by the ``prefix`` policy's guess.

An engine that goes down, leaves the pool, or comes back as a new instance (its Info's
``instance_id`` changed) loses its entries at once (``EnginePool`` stops its stream), and a new
stream starts from sequence 0 when it is healthy again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from pdserve.engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    seq_bytes,
)
from pdserve.router.discovery import address_host
from pdserve.router.kv_index import KVBlockIndex, PendingBlocks

if TYPE_CHECKING:
    from pdserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
# With no batch for this long, ask the replay socket whether one was missed.
IDLE_CHECK_S = 2.0
# Events per second are counted over this window.
RATE_WINDOW_S = 10.0


def zmq_host(grpc_address: str) -> str:
    """The host part of ``host:port`` / ``[v6]:port``, as a ZMQ tcp address wants it."""
    host = address_host(grpc_address)
    return f"[{host}]" if ":" in host else host


class EngineEventStream:
    """One engine's event stream, applied to the shared index under the engine's address."""

    def __init__(
        self,
        engine: str,
        host: str,
        port: int,
        replay_port: int,
        index: KVBlockIndex,
        metrics: RouterMetrics | None = None,
        pending: PendingBlocks | None = None,
    ) -> None:
        self.engine = engine
        self.pub_address = f"tcp://{host}:{port}"
        self.replay_address = f"tcp://{host}:{replay_port}"
        self.index = index
        self.pending = pending  # blocks routed to the engine: each leaves with its BlockStored
        self.metrics = metrics
        self.expected = 0  # the next sequence number to apply
        self.in_sync = False
        self.num_replays = 0
        self.num_resyncs = 0
        self.num_events = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, events)
        self._ctx = zmq.asyncio.Context.instance()
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.engine}")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def stop(self) -> None:
        """Stop reading and forget the engine's entries (synchronously: routing sees it at once)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.in_sync = False
        self.index.clear(self.engine)
        if self.pending is not None:
            self.pending.clear(self.engine)
        self._set_gauges()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.pub_address)
        try:
            await asyncio.sleep(0.1)  # let the subscription reach the publisher before replaying
            await self._catch_up()
            while True:
                if not await sub.poll(int(IDLE_CHECK_S * 1000)):
                    await self._catch_up()  # quiet: was the last batch lost?
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("%s: malformed KV event message (%d frames)", self.engine, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < self.expected:
                    continue  # already applied (from a replay)
                if seq > self.expected:
                    logger.info(
                        "%s: KV events %d..%d missing, replaying", self.engine, self.expected, seq - 1
                    )
                    await self._catch_up()
                    if seq < self.expected:
                        continue
                self._apply(seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s: KV event stream failed", self.engine)
            self.in_sync = False
        finally:
            sub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
                self._replay = None

    async def _catch_up(self) -> None:
        """Replay from ``expected``; resync when the engine's buffer no longer reaches back."""
        batches = await self._request_replay(self.expected)
        if not batches:
            return  # none missed; or no answer, tried again at the next gap or quiet spell
        first = batches[0][0]
        if first > self.expected:
            self.num_resyncs += 1
            if self.metrics is not None:
                self.metrics.kv_resyncs.labels(engine=self.engine).inc()
            logger.warning(
                "%s: KV events from %d are gone from the engine's buffer (it starts at %d): "
                "dropping its entries, resyncing from its snapshot",
                self.engine,
                self.expected,
                first,
            )
            self.index.clear(self.engine)
            self.in_sync = False  # until the snapshot's AllBlocksCleared
            self.expected = first
        elif self.expected > 0:  # a gap filled (not the first replay, from 0)
            self.num_replays += 1
            if self.metrics is not None:
                self.metrics.kv_replays.labels(engine=self.engine).inc()
        for seq, payload in batches:
            if seq >= self.expected:
                self._apply(seq, payload)

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.IPV6, 1)
            self._replay.connect(self.replay_address)
        batches: list[tuple[int, bytes]] = []
        await self._replay.send_multipart((b"", seq_bytes(start)))
        while True:
            if not await self._replay.poll(int(REPLAY_TIMEOUT_S * 1000)):
                # A lost answer would pair with the next request: start over on a new socket.
                self._replay.close(linger=0)
                self._replay = None
                return None
            frames = await self._replay.recv_multipart()
            if len(frames) != 4:
                continue
            _, _, seq, payload = frames
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big", signed=True), payload))

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            logger.warning("%s: KV event batch %d dropped: %s", self.engine, seq, exc)
            self.expected = seq + 1
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.store(self.engine, event.block_hashes)
                if self.pending is not None:
                    self.pending.stored(self.engine, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.remove(self.engine, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(self.engine)
                self.in_sync = True  # the stream's start, or a snapshot: exact from here
        self.expected = seq + 1
        self.num_events += len(batch.events)
        now = time.monotonic()
        self._recent.append((now, len(batch.events)))
        if self.metrics is not None:
            self.metrics.kv_events.labels(engine=self.engine).inc(len(batch.events))
        self._set_gauges(now)

    def events_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _set_gauges(self, now: float | None = None) -> None:
        if self.metrics is None:
            return
        self.metrics.kv_index_blocks.labels(engine=self.engine).set(self.index.num_blocks(self.engine))
        self.metrics.kv_events_rate.labels(engine=self.engine).set(self.events_per_second(now))
        self.metrics.kv_in_sync.labels(engine=self.engine).set(int(self.in_sync))


class KVEventTracker:
    """Every engine's stream, started and stopped by the engine pool as engines come and go."""

    def __init__(self, metrics: RouterMetrics | None = None) -> None:
        self.index = KVBlockIndex()
        self.pending = PendingBlocks()
        self.metrics = metrics
        self.streams: dict[str, EngineEventStream] = {}  # {engine address: its stream}
        self.instances: dict[str, str] = {}  # {engine address: instance id its stream follows}

    def engine_up(self, address: str, instance_id: str, port: int, replay_port: int) -> None:
        """An engine answered Info while healthy: follow its events (again, if it restarted)."""
        stream = self.streams.get(address)
        same_instance = self.instances.get(address) == instance_id
        if stream is not None and same_instance and stream.running:
            return
        if stream is not None:
            if not same_instance:
                logger.info("%s restarted (new instance %s): its KV index entries go", address, instance_id)
            stream.stop()  # (a stream that failed starts over)
        if not port:
            self.streams.pop(address, None)
            return
        stream = EngineEventStream(
            address, zmq_host(address), port, replay_port, self.index, self.metrics, self.pending
        )
        self.streams[address] = stream
        self.instances[address] = instance_id
        stream.start()

    def engine_gone(self, address: str) -> None:
        """Down, or out of the pool: its entries go at once."""
        stream = self.streams.pop(address, None)
        self.instances.pop(address, None)
        if stream is not None:
            stream.stop()

    def in_sync(self, address: str) -> bool:
        stream = self.streams.get(address)
        return stream is not None and stream.in_sync

    def routed(self, address: str, block_hashes: list[int]) -> None:
        """A prompt of these blocks was just sent to the engine: count the ones it does not
        hold yet as pending there, until its BlockStored for them arrives."""
        held = self.index.hashes_of.get(address, ())
        self.pending.add(address, [h for h in block_hashes if h not in held])

    def matched_blocks(self, address: str, block_hashes: list[int]) -> int:
        """Leading blocks of a prompt the engine holds, or will hold once the prompts routed
        to it are stored (``PendingBlocks``): what its prefix cache should hit."""
        if not self.pending.num_blocks(address):
            return self.index.matched_blocks(address, block_hashes)
        held = self.index.hashes_of.get(address, ())
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held and not self.pending.holds(address, block_hash):
                break
            count += 1
        return count

    def close(self) -> None:
        for address in list(self.streams):
            self.engine_gone(address)
