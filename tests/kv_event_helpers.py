"""Ask an engine's KV-event replay socket for what it holds (tests of the publisher and routing)."""

from __future__ import annotations

import zmq

from pdserve.engine.kv_events import END_SEQ, EventBatch, decode_batch, seq_bytes


def replay_batches(replay: zmq.Socket, start: int, timeout_ms: int = 5000) -> list[tuple[int, EventBatch]]:
    """``(sequence number, batch)`` for every batch the replay socket sends back from ``start``,
    through the end marker (``replay`` is a connected DEALER)."""
    replay.send_multipart((b"", seq_bytes(start)))
    batches = []
    while True:
        assert replay.poll(timeout_ms), "no replay answer"
        _, _, seq, payload = replay.recv_multipart()
        if seq == END_SEQ:
            return batches
        batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
