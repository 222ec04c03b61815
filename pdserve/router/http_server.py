"""uvicorn on the router's loop, with nothing that wakes the router while no request comes.

uvicorn's ``main_loop`` ticks ten times a second: to refresh the ``Date`` header once a second
and to see whether it should stop. Each wake-up of an idle router cost it 0.1-1.8 ms of CPU on
a 2-core VM whose cores the engines keep busy (cold caches), taken from an engine core. Here
the ``Date`` header is made when a response asks for the server's default headers (once per
second at most), and ``stop()`` wakes the loop itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from email.utils import formatdate

import uvicorn
from uvicorn.server import ServerState


class _DatedServerState(ServerState):
    """uvicorn's state shared by its connections, whose default headers carry a ``Date`` made
    on demand: the second a request's headers were read in (uvicorn reads them then)."""

    def __init__(self, date_header: bool, encoded_headers: list[tuple[bytes, bytes]]) -> None:
        self._date_header = date_header
        self._extra_headers = list(encoded_headers)
        self._second = -1
        self._headers = self._extra_headers
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        if not self._date_header:
            return self._extra_headers
        now = int(time.time())
        if now != self._second:
            date = formatdate(now, usegmt=True).encode()
            self._headers, self._second = [(b"date", date), *self._extra_headers], now
        return self._headers

    @default_headers.setter
    def default_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """uvicorn's tick sets them (date + the configured ones): made on demand here instead."""


class EmbeddedServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the router handles SIGTERM/SIGINT and stops it."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        if not config.loaded:
            config.load()  # the configured headers, encoded (serve() would load it anyway)
        self.server_state = _DatedServerState(config.date_header, config.encoded_headers)
        self.stopping = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        await self.stopping.wait()

    def stop(self) -> None:
        self.should_exit = True
        self.stopping.set()
