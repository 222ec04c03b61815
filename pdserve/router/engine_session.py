"""The router's end of an engine's ``Session`` stream: many requests over one gRPC call.

One ``Generate`` call per request costs a gRPC message per request per token on both ends; a
session carries every request this router runs on the engine, and the engine answers each step
with one message for all of them (``pdserve.engine.front_session``). Each request still looks
like a call of its own to the request path (``RouterServicer._stream_stage``): a
``SessionStream`` is iterated for its messages, ``cancel()`` ends it (the engine aborts it), it
ends at its deadline with DEADLINE_EXCEEDED, and a refusal or failure raises the
``grpc.aio.AioRpcError`` a ``Generate`` call would have raised: the same status codes, so
retries, resumes and aborts are decided as before.

The call opens at the first request and opens again after it fails (an engine restart, a
drain's end): requests on a failed call fail UNAVAILABLE, which the request path retries or
resumes elsewhere.

Where the engine announces a ``session_port`` (its ``Info``), the session's messages go framed
on plain TCP instead (``FramedSessionCall``; the engine's ``session_stream``): the same
messages and the same behaviour, without gRPC's thread hops per message (about a millisecond
of CPU on each end per engine step on a 2-core VM). An engine that cannot be reached there gets
the RPC.

On a framed session, a request handed to the C token relay (``use_relay``) has its plain
tokens written to its client by the relay, in the frame's read callback, while its stream is
idle (``pdserve.router.token_relay``); anything else of it comes here as before, after what the
relay sent is taken back into the request path (``on_relayed``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from pdserve.router import token_relay
from pdserve.router.discovery import address_host
from pdserve.session_frames import FrameError, frame, take_frames
from pdserve.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

# A framed stream not answering in this time (a firewall dropping the port) is given up for the
# Session RPC.
STREAM_CONNECT_TIMEOUT_S = 2.0
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()  # put in a stream's queue by cancel()
# Statuses of the whole Session call that say the stream broke, not that a request was refused.
_SESSION_BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _ignore(relayed: token_relay.Relayed) -> None:
    pass


def _never() -> None:
    return None


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a ``Generate`` call would have ended with."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class SessionStream:
    """One request's messages from an engine's session, iterated like a server-streaming call."""

    def __init__(self, call: _SessionCall, request_id: str, deadline: float) -> None:
        self._call = call
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False  # finished, failed or aborted: the engine holds nothing for it
        # The request path's relay of a plain token, called in the session's reader (see
        # ``deliver``); None: every message goes through the queue.
        self.fast: Callable[[engine_pb2.EngineGenerateResponse], bool] | None = None
        # The C relay, while it holds this request (``use_relay``).
        self._relay: token_relay.TokenRelay | None = None
        self._relay_key = request_id.encode()
        self._on_relayed: Callable[[token_relay.Relayed], None] = _ignore
        self._relay_ready: Callable[[], tuple[float, int] | None] = _never
        self._relay_error: Exception | None = None  # taking back the relay's tokens failed
        # Activated since the last take: only then can the relay have sent anything (a request
        # Python relays itself, out of step, pays no take a token).
        self._relay_armed = False
        self._waiting = False  # the iterator waits for a message, done with every one before
        self._ended = False  # the iterator gave the last message
        # One timer for the whole request (not one per message): at the deadline, end it.
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        if not self.done:
            self.close()
            self.queue.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def use_relay(
        self,
        relay: token_relay.TokenRelay,
        target: tuple[int, bytes, bytes],
        on_relayed: Callable[[token_relay.Relayed], None],
        ready: Callable[[], tuple[float, int] | None],
    ) -> bool:
        """Hand the request's plain tokens to the C relay, on a framed session: ``target`` is
        the client's socket and the chunk's template (``TokenRelay.register``); ``on_relayed``
        takes back what the relay sent, before anything else of the request is handled;
        ``ready`` gives (the last token's time, the cached tokens seen) when the request path
        is in step for the relay to go on (else None). False: Python relays it all."""
        call = self._call
        if self._relay is not None or self.done or not call.relaying():
            return False
        fd, head, tail = target
        if not relay.register(call.number, self._relay_key, fd, head, tail):
            return False
        self._relay, self._on_relayed, self._relay_ready = relay, on_relayed, ready
        return True

    def _relay_on(self) -> None:
        """Let the relay send the next outputs, if the request path is in step for it."""
        relay = cast(token_relay.TokenRelay, self._relay)
        if self.request_id in self._call.aborting:
            return
        ready = self._relay_ready()
        if ready is not None:
            relay.activate(self._call.number, self._relay_key, *ready)
            self._relay_armed = True

    def _relay_off(self) -> None:
        """Stop the relay, and take back what it sent (it declined an output: that comes next).
        Where that fails, the relay lets go of the request and ``deliver`` fails it."""
        if not self._relay_armed:
            return
        self._relay_armed = False
        relay = cast(token_relay.TokenRelay, self._relay)
        try:
            relayed = relay.take(self._call.number, self._relay_key)
            if relayed is not None:
                self._on_relayed(relayed)
        except Exception as exc:  # noqa: BLE001 - one request's bug must not end the session
            logger.exception("%s: the router failed to take back the token relay's tokens", self.request_id)
            relay.unregister(self._call.number, self._relay_key)
            self._relay = None
            self._relay_error = exc

    def sync_relay(self) -> None:
        """A chunk of the relay's went out in part: the rest goes to the transport now."""
        if self._relay is not None:
            self._relay_off()

    def _release_relay(self) -> None:
        if self._relay is not None:
            self._relay_off()
            if self._relay is not None:  # else _relay_off let go of it already
                self._relay.unregister(self._call.number, self._relay_key)
                self._relay = None

    def finish(self) -> None:
        """It ended on the engine's side (or never started there): nothing to abort."""
        self._release_relay()
        self.done = True
        self._timer.cancel()

    def deliver(self, message: engine_pb2.EngineGenerateResponse) -> None:
        """Hand the iterator a message, or relay it at once through ``fast``.

        A token of a streaming answer costs the router a queue hop, a task wake-up and a
        generator layer per stage of the request path; ``fast`` does the same relay in the
        reader's callback, which on two busy cores is about half the router's CPU per token
        (docs/performance.md). It runs only while the iterator waits with nothing queued (so
        every message before went out, in order) and may decline (returns False: a last
        message, a client not reading), and then the message and every later one queue as
        before. A relay that raises fails the request (INTERNAL), not the session; so does taking
        back what the C token relay sent."""
        if self._relay is not None:
            self._relay_off()
        if self._relay_error is not None:
            self._fail(self._relay_error)
            return
        fast = self.fast
        if fast is not None and self._waiting and self.queue.empty():
            try:
                if fast(message):
                    if self._relay is not None:
                        self._relay_on()
                    return
            except Exception as exc:  # noqa: BLE001 - one request's bug must not end the session
                logger.exception("%s: the router failed to relay a token", self.request_id)
                self._fail(exc)
                return
        self.queue.put_nowait(message)

    def _fail(self, exc: Exception) -> None:
        self.fast = None
        self._relay_error = None
        self.close()
        self.queue.put_nowait(
            rpc_error(grpc.StatusCode.INTERNAL, f"the router failed to relay a token: {exc!r}")
        )

    def cancel(self) -> None:
        """Stop now: the iterator raises CancelledError at its next step, before any message
        still queued (an aborted request's tokens, even its last one, are not relayed), and the
        engine aborts the request."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_CANCELLED)
        self.close()

    def close(self) -> None:
        """Leave the session; a request that has not finished is aborted on the engine."""
        self.fast = None
        self._release_relay()
        self._timer.cancel()
        if not self.done:
            self.done = True
            self._call.abort(self.request_id)

    def __aiter__(self) -> SessionStream:
        return self

    async def __anext__(self) -> engine_pb2.EngineGenerateResponse:
        # An iterator, not an async generator: the request path stops reading at the last
        # message, and a generator left there is closed by a task of its own after it is
        # collected (asyncio's finalizer hook), one a stage.
        if self._ended:
            raise StopAsyncIteration
        self._waiting = True
        if self._relay is not None and self.queue.empty():
            self._relay_on()
        try:
            item = await self.queue.get()
        finally:
            self._waiting = False
        if item is _CANCELLED:
            self._ended = True
            raise asyncio.CancelledError()
        if isinstance(item, grpc.aio.AioRpcError):
            self._ended = True
            raise item
        self._ended = bool(item.finish_reason)
        return item


class FramedSessionCall:
    """A Session call on the engine's framed stream: ``serve(handle)`` hands each response to
    ``handle`` as it arrives, ``cancel()`` ends it. The stream breaking fails it UNAVAILABLE, as
    a broken RPC does; an engine not listening gets the RPC instead (``rpc``).

    Frames are cut and parsed in the protocol's ``data_received``, and each response handled
    there, in the callback of the socket's read event: a ``StreamReader`` woke the reading task
    for every frame (one more pass of the event loop per engine step, and two awaits of
    ``readexactly``)."""

    def __init__(
        self,
        address: str,
        port: int,
        requests: AsyncIterator[engine_pb2.SessionRequest],
        rpc: Callable[[AsyncIterator[engine_pb2.SessionRequest]], Any],
        number: int = 0,
    ) -> None:
        self.host = address_host(address)
        self.number = number  # the session's in the token relay; 0: its frames skip the relay
        self.address = address
        self.port = port
        self._requests = requests
        self._rpc = rpc
        self._rpc_call: Any = None
        self._protocol: _FrameProtocol | None = None
        self._sender: asyncio.Task | None = None
        self._cancelled = False

    def framed(self) -> bool:
        """True while the framed stream is up (not the RPC it fell back to)."""
        return self._protocol is not None and not self._protocol.ended.done()

    def cancel(self) -> None:
        self._cancelled = True
        if self._rpc_call is not None:
            self._rpc_call.cancel()
        if self._sender is not None:
            self._sender.cancel()
        if self._protocol is not None:
            self._protocol.close()

    async def serve(self, handle: Callable[[engine_pb2.SessionResponse], None]) -> None:
        """Hand every response to ``handle`` until the engine ends the stream (returns) or it
        breaks (``AioRpcError`` UNAVAILABLE); what ``handle`` raises ends the call and is raised."""
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _FrameProtocol(handle, self.number), self.host, self.port),
                STREAM_CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            logger.warning(
                "engine %s: no Session stream on port %d (%s): using the Session RPC",
                self.address,
                self.port,
                str(exc) or type(exc).__name__,
            )
            self._rpc_call = self._rpc(self._requests)
            if self._cancelled:
                self._rpc_call.cancel()
            async for response in self._rpc_call:
                handle(response)
            return
        self._protocol = protocol
        self._sender = asyncio.create_task(self._send(protocol), name=f"session-send-{self.address}")
        try:
            if self._cancelled:
                raise asyncio.CancelledError()
            await protocol.ended
        except (OSError, asyncio.IncompleteReadError, FrameError, DecodeError) as exc:
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"engine {self.address}: its Session stream broke ({exc!r})"
            ) from None
        finally:
            self.cancel()

    async def _send(self, protocol: _FrameProtocol) -> None:
        async for message in self._requests:
            if not await protocol.write(frame(message.SerializeToString())):
                return  # a broken stream: the reader fails the session


class _FrameProtocol(asyncio.Protocol):
    """The router's end of a framed Session connection: responses in, requests out."""

    def __init__(self, handle: Callable[..., None], session: int = 0) -> None:
        self.handle = handle
        self.session = session
        self.buffer = bytearray()
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read here if the call was cancelled before awaiting it (no "never retrieved" warning).
        self.ended.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
        self.transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        payloads, bad = take_frames(self.buffer)
        # Only a router's session (numbered) goes through the relay: another handler takes the
        # whole response alone.
        relay = token_relay.frames() if self.session else None
        try:
            for payload in payloads:
                if relay is not None:
                    # The relay's plain tokens go out in C; what it declines, or what went out
                    # in part, is handled here (None: all of it).
                    outcome = relay.frame(self.session, payload)
                    if outcome is not None:
                        if outcome[0] or outcome[1]:
                            self.handle(engine_pb2.SessionResponse.FromString(payload), *outcome)
                        continue
                self.handle(engine_pb2.SessionResponse.FromString(payload))
            if bad is not None:
                raise bad
        except Exception as exc:  # a bad frame, or what the handler raised: the call ends
            self.buffer = bytearray()
            self._end(exc)
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost() follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()  # a waiting writer sees the transport closed
        if exc is None and self.buffer:
            exc = asyncio.IncompleteReadError(bytes(self.buffer), None)
        self._end(exc)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def write(self, data: bytes) -> bool:
        """Send ``data``, then wait while the kernel's buffer is full; False once closed."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        await self._writable.wait()
        return not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _end(self, exc: BaseException | None) -> None:
        if not self.ended.done():
            if exc is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(exc)


class _SessionCall:
    """One Session call and the streams of the requests sent on it."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub, address: str, stream_port: int = 0) -> None:
        self.address = address
        self.outbox: asyncio.Queue[engine_pb2.SessionRequest | None] = asyncio.Queue()
        self.streams: dict[str, SessionStream] = {}
        # {request_id: aborts sent that the engine has not answered}: until it does, what
        # arrives for the id is the aborted request's, even when a new one reuses the id.
        self.aborting: collections.Counter[str] = collections.Counter()
        self.failed = False
        self.number = token_relay.new_session_number()
        self.call: Any = (
            FramedSessionCall(address, stream_port, self._requests(), stub.Session, self.number)
            if stream_port
            else stub.Session(self._requests())
        )
        self.reader = asyncio.create_task(self._read(), name=f"session-{address}")

    async def _requests(self) -> AsyncIterator[engine_pb2.SessionRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    def open(self, request: engine_pb2.EngineGenerateRequest, deadline: float) -> SessionStream:
        stream = SessionStream(self, request.request_id, deadline)
        if request.request_id in self.streams:
            stream.finish()
            stream.queue.put_nowait(
                rpc_error(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running"
                )
            )
            return stream
        self.streams[request.request_id] = stream
        self.outbox.put_nowait(engine_pb2.SessionRequest(generate=request))
        return stream

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None and not self.failed:
            self.aborting[request_id] += 1
            self.outbox.put_nowait(engine_pb2.SessionRequest(abort_request_id=request_id))

    def relaying(self) -> bool:
        """True while the session is framed (its frames go through the token relay)."""
        return isinstance(self.call, FramedSessionCall) and self.call.framed()

    def _handle(
        self,
        response: engine_pb2.SessionResponse,
        declined: list[int] | None = None,
        flushed: list[int] | None = None,
    ) -> None:
        """One message of the engine's: each output to its request's stream, aborts answered,
        refusals raised in their requests. After the token relay: only the outputs it
        ``declined`` (by index), and the streams of those it sent in part (``flushed``) synced."""
        outputs = response.outputs
        for index in flushed or ():
            if (stream := self.streams.get(outputs[index].request_id)) is not None:
                stream.sync_relay()
        if declined is not None:
            outputs = [outputs[index] for index in declined]
        for request_id in response.aborted:
            self.aborting[request_id] -= 1
            if self.aborting[request_id] <= 0:
                del self.aborting[request_id]
        for output in outputs:
            if output.request_id in self.aborting:
                continue  # of a request aborted meanwhile
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue
            if output.finish_reason:
                del self.streams[output.request_id]
                stream.finish()
            stream.deliver(output)
        for failure in response.errors:
            if failure.request_id in self.aborting:
                continue
            stream = self.streams.pop(failure.request_id, None)
            if stream is not None:
                stream.finish()
                code = _STATUS_BY_VALUE.get(failure.code, grpc.StatusCode.UNKNOWN)
                stream.queue.put_nowait(rpc_error(code, failure.message))

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"engine {self.address} ended the session")
        try:
            if isinstance(self.call, FramedSessionCall):
                await self.call.serve(self._handle)
            else:
                async for response in self.call:
                    self._handle(response)
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() in _SESSION_BROKEN:
                # The stream broke under all of its requests (an engine stopping mid-write has
                # given "Internal error from Core"): no verdict on any one request, so each fails
                # as an unreachable engine's would, and is retried or resumed elsewhere.
                error = rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"engine {self.address} broke the session ({exc.code().name}: {exc.details()})",
                )
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed the session")
            raise
        finally:
            self.failed = True
            # The call is over (or broken): release it, and end its request iterator.
            self.call.cancel()
            self.outbox.put_nowait(None)
            if self.streams:
                logger.warning(
                    "session with engine %s ended (%s) with %d requests: failing them",
                    self.address,
                    error.code().name,
                    len(self.streams),
                )
            for stream in self.streams.values():
                stream.finish()
                stream.queue.put_nowait(error)
            self.streams.clear()

    async def close(self) -> None:
        self.outbox.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self.reader


class EngineSession:
    """The router's session with one engine: ``open`` a request's stream on it."""

    def __init__(
        self, stub: engine_pb2_grpc.EngineStub, address: str, stream_port: Callable[[], int] = lambda: 0
    ) -> None:
        self.stub = stub
        self.address = address
        self.stream_port = stream_port  # the engine's framed Session port (its Info), 0: none
        self._call: _SessionCall | None = None

    def open(self, request: engine_pb2.EngineGenerateRequest, timeout: float) -> SessionStream:
        """Send ``request``; its messages arrive on the stream returned, until ``timeout`` s."""
        if self._call is None or self._call.failed:
            self._call = _SessionCall(self.stub, self.address, self.stream_port())
        return self._call.open(request, asyncio.get_running_loop().time() + timeout)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()
            self._call = None
