"""The engine's Session stream without gRPC: the same messages, framed on plain TCP
(``pdserve.session_frames``), served by the engine core itself.

A router that finds ``session_port`` in the engine's ``Info`` opens its session here; one that
does not (or cannot connect) keeps using the ``Session`` RPC. Everything a request sees is the
RPC's: the checks, the refusals and their status codes, one message a step, the aborts. A
router that goes away (the connection closes, or breaks) has its requests aborted and their
blocks freed, as a cancelled RPC has. The router is this stream's only client: it sends nothing
before its requests (no handshake), and the engine's gRPC port is as open as this one.

The front only listens: each connection it accepts goes to the core at once (``SCM_RIGHTS`` on a
Unix socket the two share, ``hand_over``), before the front reads a byte of it, and the front
closes its copy. The core reads the requests and writes the outputs (``core_sessions``), so
neither a request's arrival, nor its tokens, nor its end wakes the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable

logger = logging.getLogger(__name__)

SESSION_ID = struct.Struct("!Q")  # what the front sends with a session's socket
LISTEN_BACKLOG = 64


def hand_over(channel: socket.socket, session: int, connection: socket.socket) -> None:
    """Send ``connection`` (a framed session) to the core as ``session``."""
    socket.send_fds(channel, [SESSION_ID.pack(session)], [connection.fileno()])


class SessionListener:
    """Accepts routers' framed sessions and gives each to ``take`` (which hands it to the core,
    or raises OSError when it cannot: the connection is then closed, which the router reads as
    an engine it cannot use)."""

    def __init__(self, host: str, port: int, take: Callable[[socket.socket], object]) -> None:
        self._take = take
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                connection, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: the router retries
                logger.warning("session stream: accept failed: %s", exc)
                return
            with connection:  # the core has its own copy now (or none: the router sees the end)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    self._take(connection)
                except Exception as exc:  # noqa: BLE001 - one connection, not the listener
                    logger.warning("session stream from %s: not handed to the core (%s)", peer, exc)

    def close(self) -> None:
        """Accept no more sessions; the open ones are the core's, and end with the drain."""
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
