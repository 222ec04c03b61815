"""Ask an engine's KV-event replay socket for what it holds (tests of the publisher and routing)."""

from __future__ import annotations

import grpc
import zmq

from pdserve.engine.kv_events import END_SEQ, EventBatch, decode_batch, seq_bytes
from pdserve.v1 import engine_pb2, engine_pb2_grpc


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


def engine_stream(address: str) -> list:
    """Every event the engine's replay buffer holds, from sequence 0 (what it published)."""
    with grpc.insecure_channel(address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=5)
    host = address.rpartition(":")[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://{host}:{info.kv_events_replay_port}")
        return [event for _, batch in replay_batches(sock, 0) for event in batch.events]
    finally:
        sock.close(linger=0)
        ctx.term()
