"""An engine stub whose ``Session`` returns a call the test scripted: the router's end of a
session (``EngineSession``) driven without an engine."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.v1 import engine_pb2


class SessionStub:
    def __init__(self, call: Any) -> None:
        self.call = call

    def Session(self, requests: Any) -> Any:  # noqa: N802 (gRPC's method name)
        return self.call


class ScriptedCall:
    """A Session call that answers ``responses`` (with ``pause``, letting the loop run between
    them, as frames arriving apart do), then ends with ``error``, or without one stays open
    until cancelled. ``sent`` is set once every response went out."""

    def __init__(
        self,
        responses: list[engine_pb2.SessionResponse],
        *,
        pause: bool = False,
        error: grpc.aio.AioRpcError | None = None,
    ) -> None:
        self.responses, self.pause, self.error = responses, pause, error
        self.sent = asyncio.Event()
        self.closed = asyncio.Event()
        self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        await asyncio.sleep(0.01)  # the requests go out first
        for response in self.responses:
            yield response
            if self.pause:
                await asyncio.sleep(0)
        self.sent.set()
        if self.error is not None:
            raise self.error
        await self.closed.wait()

    def cancel(self) -> bool:
        self.cancelled = True
        self.closed.set()
        return True
