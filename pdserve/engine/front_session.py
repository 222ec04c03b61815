"""One router's ``Session`` stream on an engine front: many requests, one message per step.

A ``Generate`` call streams one gRPC message per request per token; at 8 streams that is 8
messages a step, each a few tens of microseconds of the front's and the router's CPU, taken
from the engine cores on a small machine. A session carries every request its router sends
this engine: the core's outputs of one step (``_on_outputs`` hands them over in one call of the
loop, with no await between them) leave as one ``SessionResponse``. vLLM's engine core streams
its outputs to the API server the same way (one msgpack message per step over ZMQ).

The session only collects; ``EngineServicer.Session`` validates, starts and aborts requests
and writes the batches. (A framed stream carries the same messages without the front: the core
serves it, ``core_sessions``.)
"""

from __future__ import annotations

import asyncio
import time

from pdserve.engine.outputs import EngineCoreOutput
from pdserve.v1 import engine_pb2


class FrontSession:
    """The requests of one Session stream and what the core produced for them since the last
    message: the sink ``AsyncEngineCoreClient.open_stream`` routes their outputs to."""

    def __init__(self) -> None:
        # {request_id: front events not yet sent (its first message carries them)}
        self.requests: dict[str, dict[str, float]] = {}
        self.outputs: list[EngineCoreOutput] = []
        self.errors: list[engine_pb2.RequestError] = []
        self.aborted: list[str] = []  # ids whose abort was taken, for the next message
        self.wake = asyncio.Event()

    def add(self, request_id: str) -> None:
        self.requests[request_id] = {"front_received": time.time()}

    def put_nowait(self, output: EngineCoreOutput, /) -> None:
        self.outputs.append(output)
        self.wake.set()

    def refuse(self, request_id: str, code: int, message: str) -> None:
        """Answer a request that did not start with a status (a running request of the same
        id, if any, goes on)."""
        self.errors.append(engine_pb2.RequestError(request_id=request_id, code=code, message=message))
        self.wake.set()

    def fail(self, request_id: str, code: int, message: str) -> None:
        """End ``request_id`` with a status (it is no longer the session's)."""
        self.requests.pop(request_id, None)
        self.refuse(request_id, code, message)

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id``: what it produced and was not sent yet goes, and the next message
        says so (the router then knows later outputs of the id are a new request's). True if it
        was still running here."""
        running = self.requests.pop(request_id, None) is not None
        self.outputs = [o for o in self.outputs if o.request_id != request_id]
        self.errors = [e for e in self.errors if e.request_id != request_id]
        self.aborted.append(request_id)
        self.wake.set()
        return running

    def take(self) -> tuple[list[EngineCoreOutput], list[engine_pb2.RequestError], list[str]]:
        """What arrived since the last call, of requests still in the session, and the aborts."""
        outputs = [o for o in self.outputs if o.request_id in self.requests]
        errors, aborted = self.errors, self.aborted
        self.outputs, self.errors, self.aborted = [], [], []
        self.wake.clear()
        return outputs, errors, aborted
