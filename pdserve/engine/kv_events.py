"""KV-cache events: what an engine's prefix cache gains and loses, published for routers.

The wire format is vLLM's (``vllm/distributed/kv_events.py``), so a consumer written for vLLM
(Dynamo's KV router, llm-d's precise prefix-cache scorer, vLLM's own ``KVEventBatch`` decoder)
reads pdserve's stream as it is:

- a PUB socket sends one message per engine step that changed the cache, three frames:
  ``(topic, seq as 8-byte big-endian, payload)``; ``seq`` starts at 0 and grows by one;
- ``payload`` is msgpack ``[ts, [event, ...], data_parallel_rank]``, each event a map tagged by
  ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved`` (``block_hashes``,
  ``medium``) or ``AllBlocksCleared``;
- a ROUTER socket replays: a request ``(b"", start_seq as 8 bytes)`` gets every buffered batch
  with ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``.

The block hashes are pdserve's own prefix-cache keys (``kv_cache.hash_block_tokens``: Python's
``hash((parent_hash, block_tokens))``, a signed 64-bit int, the same in every process because
ints and tuples of ints are not salted), which is also what the router computes for a prompt
(``hash_request_blocks``); vLLM's ``ExternalBlockHash`` is ``bytes | int``, so they go as ints.
They are not vLLM's hashes (SHA-256 over CBOR with a per-process random seed unless
``PYTHONHASHSEED`` is set): a pdserve stream and a vLLM stream cannot share one index.

The first batch an engine publishes (seq 0) is ``AllBlocksCleared``: a subscriber replaying
from 0 starts from an empty cache. When a subscriber asks for a sequence number older than the
buffer holds, the next published batch opens with ``AllBlocksCleared`` plus a ``BlockStored``
for every block then cached (a snapshot), so the subscriber can drop what it had and be exact
again from there.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from pdserve.wake_pipe import WakePipe

logger = logging.getLogger(__name__)

MEDIUM = "CPU"  # where pdserve's blocks live (vLLM says "GPU" for its device cache)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
# Fault injection for tests: a comma-separated list of sequence numbers the PUB socket skips
# (they stay in the replay buffer), as a message lost on the network would be.
DROP_SEQS_ENV = "PDSERVE_KV_EVENTS_DROP_SEQS"


@dataclass
class BlockStored:
    """Consecutive blocks of one request entered the prefix cache; ``parent_block_hash`` is
    the hash of the block before the first (None at the start of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }


@dataclass
class BlockRemoved:
    """These hashes left the prefix cache (their last block was reused or invalidated)."""

    block_hashes: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": MEDIUM}


@dataclass
class AllBlocksCleared:
    """The prefix cache is empty (a reset, or the start of a stream or a snapshot)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    """The events of one engine step, as published under one sequence number."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack, laid out as vLLM's ``KVEventBatch`` (an array-like struct of tagged maps)."""
    return msgpack.packb([batch.ts, [e.to_wire() for e in batch.events], None], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """The inverse of ``encode_batch``; ValueError on anything else (a subscriber must survive
    a malformed message)."""
    try:
        plain = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, raw_events = float(plain[0]), plain[1]
        events: list[KVCacheEvent] = []
        for raw in raw_events:
            kind = raw["type"]
            if kind == "BlockStored":
                events.append(
                    BlockStored(
                        [int(h) for h in raw["block_hashes"]],
                        None if raw["parent_block_hash"] is None else int(raw["parent_block_hash"]),
                        [int(t) for t in raw["token_ids"]],
                        int(raw["block_size"]),
                    )
                )
            elif kind == "BlockRemoved":
                events.append(BlockRemoved([int(h) for h in raw["block_hashes"]]))
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown event type {kind!r}")
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from None
    return EventBatch(ts, events)


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind on ``host:port`` (a free port for 0); the port bound."""
    address = f"[{host}]" if ":" in host else host
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{address}")
    sock.bind(f"tcp://{address}:{port}")
    return port


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """The PUB socket, used by the engine's thread, and the replay ROUTER socket, served by a
    thread of its own so that a replay never delays a step.

    ``publish`` numbers a batch, encodes and sends it (a PUB send never blocks) and keeps the
    last ``buffer_steps`` encoded batches for replay. ``snapshot_wanted`` is set when a replay
    asked for more than the buffer holds: the engine core then ends its next batch with a
    snapshot of its cache (``BlockPool.snapshot_events``); an idle core wakes at least every
    half second, so that happens promptly.
    """

    def __init__(
        self,
        host: str,
        port: int,
        replay_port: int,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        topic: str = "",
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._replay):
            sock.setsockopt(zmq.IPV6, 1)
        self.port = _bind(self._pub, host, port)
        self.replay_port = _bind(self._replay, host, replay_port)
        self._topic = topic.encode()
        # [(seq, payload)], oldest first; appended by the engine thread, read by the replay thread.
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()
        self._next_seq = 0
        self._drop = {int(s) for s in os.environ.get(DROP_SEQS_ENV, "").split(",") if s.strip()}
        self.snapshot_wanted = threading.Event()
        self._closing = threading.Event()
        # ``close`` wakes the replay thread through this; it otherwise sleeps until a request
        # comes (a poll every 200 ms woke an idle engine 5 times a second for nothing).
        self._waker = WakePipe()
        self._thread = threading.Thread(target=self._serve_replays, name="kv-events-replay", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = encode_batch(batch)
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        if seq in self._drop:
            logger.warning("KV events: dropping seq %d on purpose (%s)", seq, DROP_SEQS_ENV)
            return
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))

    def _serve_replays(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        while not self._closing.is_set():
            if self._replay in dict(poller.poll()):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV events: replay failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        with self._buffer_lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            oldest = self._buffer[0][0] if self._buffer else self._next_seq
        if start_seq < oldest:
            # The buffer no longer reaches back: the subscriber drops what it has, and the next
            # batch carries a snapshot of the whole cache to rebuild from.
            self.snapshot_wanted.set()
        for seq, payload in batches:
            self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._waker.wake()
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()
        self._waker.close()
