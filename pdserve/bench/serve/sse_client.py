"""A minimal asyncio client for one streamed OpenAI-API request (HTTP/1.1, server-sent events).

``bench serve --api openai`` measures the router's HTTP front against its gRPC front, so the
client must add as little of its own as it can: a raw socket, chunked transfer decoding, and
one ``json.loads`` per event, with each event's arrival time taken as soon as its line is read.
(The ``openai`` SDK drives the same endpoints in the tests; its per-chunk pydantic parsing would
be measured here as server time.)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


async def stream_events(url: str, body: dict[str, Any], timeout_s: float) -> AsyncIterator[tuple[float, Any]]:
    """POST ``body`` to ``url`` and yield ``(arrival time, parsed event)`` per ``data:`` line,
    ending at ``data: [DONE]``. A non-200 answer raises HTTPStatusError with its body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), timeout_s)
    try:
        payload = json.dumps(body).encode()
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        await writer.drain()
        deadline = time.monotonic() + timeout_s
        status_line = await _readline(reader, deadline)
        status = int(status_line.split()[1])
        headers = {}
        while (line := await _readline(reader, deadline)) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            raise HTTPStatusError(
                status, (await _read_body(reader, headers, chunked, deadline)).decode(errors="replace")
            )
        buffer = b""
        async for data in _body_pieces(reader, headers, chunked, deadline):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                arrived = time.perf_counter()
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    text = line[len(b"data: ") :]
                    if text == b"[DONE]":
                        return
                    yield arrived, json.loads(text)
    finally:
        writer.close()


async def _readline(reader: asyncio.StreamReader, deadline: float) -> bytes:
    return await asyncio.wait_for(reader.readline(), max(0.0, deadline - time.monotonic()))


async def _body_pieces(
    reader: asyncio.StreamReader, headers: dict[str, str], chunked: bool, deadline: float
) -> AsyncIterator[bytes]:
    if not chunked:
        remaining = int(headers.get("content-length", "-1"))
        while remaining != 0:
            data = await asyncio.wait_for(reader.read(65536 if remaining < 0 else min(remaining, 65536)),
                                          max(0.0, deadline - time.monotonic()))  # fmt: skip
            if not data:
                return
            remaining -= len(data) if remaining > 0 else 0
            yield data
        return
    while True:
        size = int((await _readline(reader, deadline)).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await asyncio.wait_for(reader.readexactly(size + 2), max(0.0, deadline - time.monotonic()))
        yield data[:-2]


async def _read_body(
    reader: asyncio.StreamReader, headers: dict[str, str], chunked: bool, deadline: float
) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, headers, chunked, deadline)])
