"""The engine's Session stream without gRPC: the same messages, framed on plain TCP
(``pdserve.session_frames``), served by the same ``EngineServicer.serve_session``.

A router that finds ``session_port`` in the engine's ``Info`` opens its session here; one that
does not (or cannot connect) keeps using the ``Session`` RPC. Everything a request sees is the
RPC's: the checks, the refusals and their status codes, one message a step, the aborts. A
router that goes away (the connection closes, or breaks) has its requests aborted and their
blocks freed, as a cancelled RPC has. The router is this stream's only client: it sends nothing
before its requests (no handshake), and the engine's gRPC port is as open as this one.

The front reads the stream; the engine core writes it (the connection's socket is handed to the
core, ``core_sessions``), so a step's outputs reach the router without waking the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from google.protobuf.message import DecodeError

from pdserve.session_frames import FrameError, read_frame, write_messages
from pdserve.v1 import engine_pb2

logger = logging.getLogger(__name__)


class SessionServicer(Protocol):
    """What serves a session's messages (``EngineServicer``), whatever carries them."""

    def serve_session(
        self,
        request_iterator: AsyncIterator[engine_pb2.SessionRequest],
        connection: socket.socket | None = None,
    ) -> AsyncGenerator[engine_pb2.SessionResponse, None]: ...


async def start_session_server(servicer: SessionServicer, host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` (0: a free port, ``server.sockets[0]``) for routers' sessions."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_connection(servicer, reader, writer)

    return await asyncio.start_server(serve, host, port, reuse_address=True)


async def _serve_connection(
    servicer: SessionServicer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    peer = writer.get_extra_info("peername")
    closed = asyncio.Event()  # the router closed (or broke) the connection

    async def requests() -> AsyncIterator[engine_pb2.SessionRequest]:
        try:
            while (payload := await read_frame(reader)) is not None:
                yield engine_pb2.SessionRequest.FromString(payload)
        except (OSError, asyncio.IncompleteReadError, FrameError) as exc:
            logger.warning("session stream from %s broke: %s", peer, exc)
        except DecodeError as exc:  # a frame that is not a SessionRequest
            logger.warning("session stream from %s sent a bad message: %s", peer, exc)
        closed.set()

    connection = writer.get_extra_info("socket")  # the core writes the session's outputs

    async def write_responses() -> None:
        async with contextlib.aclosing(servicer.serve_session(requests(), connection)) as responses:
            await write_messages(writer, responses)

    writing = asyncio.create_task(write_responses())
    watching = asyncio.create_task(closed.wait())
    try:
        # The router only closes its end when it leaves: whatever still runs is aborted (the
        # generator's clean-up), as when a gRPC stream is cancelled.
        await asyncio.wait({writing, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writing, watching):
            task.cancel()
        try:
            await writing
        except (asyncio.CancelledError, OSError):
            pass  # the router went away, or we stopped writing to it
        except Exception:
            logger.exception("session stream from %s failed", peer)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
