"""Framing of the Session stream's messages on plain TCP: a 4-byte big-endian length, then the
protobuf message (``SessionRequest`` one way, ``SessionResponse`` the other).

gRPC's asyncio stack hands every message between its own threads and the event loop (a read
wakes an event-engine thread, which wakes a poller thread, which wakes the loop; a write goes
back the same way): on a 2-core VM that cost about a millisecond of CPU per message on each
end, per engine step, taken from the engine cores. The same messages framed on an asyncio
stream are one ``send`` and one ``recv`` on the loop's own thread. Protobuf, never pickle: a
peer can only send messages of the two types, and a bad frame ends the connection.
"""

from __future__ import annotations

HEADER_BYTES = 4
# As the gRPC servers' limit: a prompt is far smaller than this.
MAX_FRAME_BYTES = 16 << 20


class FrameError(Exception):
    """The peer sent a frame this end refuses (too long): the connection is dropped."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front."""
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def payload_length(header: bytes | bytearray) -> int:
    """The payload length a frame's ``HEADER_BYTES`` header gives; FrameError past the limit."""
    length = int.from_bytes(header, "big")
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return length


def take_frames(buffer: bytearray) -> tuple[list[bytes], FrameError | None]:
    """The payloads of the whole frames at the start of ``buffer``, taken out of it (a frame
    not whole yet stays, for more bytes), and the FrameError of a bad header: the frames before
    it still count, nothing from it on does (``buffer`` is emptied)."""
    start, payloads = 0, []
    try:
        while len(buffer) - start >= HEADER_BYTES:
            end = start + HEADER_BYTES + payload_length(buffer[start : start + HEADER_BYTES])
            if len(buffer) < end:
                break
            payloads.append(bytes(buffer[start + HEADER_BYTES : end]))
            start = end
    except FrameError as exc:
        buffer.clear()
        return payloads, exc
    del buffer[:start]
    return payloads, None
