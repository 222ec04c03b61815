"""The framed Session streams an engine core serves itself: routers' requests in, outputs out.

A router's framed session (``session_stream``) is accepted by the engine's front, which hands
the connection's socket to the core at once (``SCM_RIGHTS`` on a Unix socket the two share) and
closes its own copy: the core reads the router's requests and aborts from it and writes each
step's outputs for that router as one ``SessionResponse`` frame. The front is off the request
path: through it, a request cost a wake-up of the front, a decode, checks and a re-encode on
arrival and again at its end, about 1.5 ms of the front's CPU a request on a 2-core VM, taken
from the engine cores (docs/performance.md). vLLM's API server likewise talks to its engine
core directly (ZMQ and msgpack).

What the router reads on a session comes from here, in the order the core did it: a request's
outputs, its error (a refusal: a bad request, an id already running, a draining engine), and
the acknowledgement ("aborted") of each abort the session sent, after which an output of that
id is a new request's. A session that closes, breaks or sends a bad frame has its requests
aborted (their blocks freed), as a cancelled Session RPC has.

The socket is non-blocking: what the router has not read yet waits here and is written as it
drains; a router that reads nothing while ``MAX_PENDING_BYTES`` pile up is cut off, which fails
its session's requests UNAVAILABLE.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from pdserve.engine.core import AbortRequests, EngineCoreRequest
from pdserve.engine.output_wire import error_status, response_fields
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.session_stream import SESSION_ID
from pdserve.session_frames import frame, take_frames
from pdserve.v1 import engine_pb2
from pdserve.wire import kv_params_from_proto, sampling_from_proto

logger = logging.getLogger("pdserve.core")

MAX_PENDING_BYTES = 64 << 20
READ_BYTES = 1 << 16

SessionInput = EngineCoreRequest | AbortRequests


@dataclass
class _Request:
    session: int
    first_events: dict[str, float] | None  # the engine's events before its first output


@dataclass
class _Session:
    connection: socket.socket
    pending: bytearray = field(default_factory=bytearray)  # written, not yet taken by the kernel
    message: engine_pb2.SessionResponse | None = None  # being filled for the next frame
    received: bytearray = field(default_factory=bytearray)  # read, not yet a whole frame


class CoreSessions:
    """The sessions handed over by the front, what each asks, and which request writes to which."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel  # SOCK_SEQPACKET: one session socket a message
        self.channel.setblocking(False)
        self._sessions: dict[int, _Session] = {}
        self._by_fd: dict[int, int] = {}  # {socket fd: session}
        # {request_id: its requests on sessions, oldest first}: an id reused right after an
        # abort has the new request bound (on input) before the old one's answer is out (the
        # abort is handled after the step in flight); outputs are the oldest one's until its last.
        self._requests: dict[str, collections.deque[_Request]] = {}
        # {request_id: sessions whose aborts of it the core has not answered yet, oldest first}
        self._abort_sessions: dict[str, collections.deque[int]] = {}
        # Set by the front's drain (the refusal's message): new requests are refused
        # UNAVAILABLE, and a session with nothing left running is closed.
        self.draining: str | None = None
        self._lost: list[tuple[int, str]] = []  # (session, why) dropped while writing to it

    # ------------------------------------------------------------------ sockets

    def accept(self) -> bool:
        """Take every session socket the front has sent; False once the front has closed its
        end (it exited: the channel then stays readable, at its end, for good)."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.channel, SESSION_ID.size, 4)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if not data and not fds:
                return False
            for extra in fds[1:]:
                socket.close(extra)
            if not fds or len(data) != SESSION_ID.size:
                logger.warning("dropped a malformed session hand-over")
                continue
            (session,) = SESSION_ID.unpack(data)
            connection = socket.socket(fileno=fds[0])
            connection.setblocking(False)
            self._sessions[session] = _Session(connection)
            self._by_fd[connection.fileno()] = session
            if self.draining is not None:
                self._close_if_idle(session)

    def readable(self) -> list[int]:
        """File descriptors of every session (the router may send on any of them)."""
        return list(self._by_fd)

    def waiting_to_write(self) -> list[int]:
        """File descriptors with bytes the router has not taken yet."""
        return [s.connection.fileno() for s in self._sessions.values() if s.pending]

    # ------------------------------------------------------------------ from the routers

    def read(self, fd: int) -> list[SessionInput]:
        """The requests and aborts the session on ``fd`` sent since the last read, in order,
        for the core's loop. A session that closed, broke or sent a bad frame is dropped, and
        its requests still running come back as one abort."""
        session = self._by_fd.get(fd)
        state = self._sessions.get(session) if session is not None else None
        if session is None or state is None:
            return []
        ended: str | None = None
        try:
            while True:
                data = state.connection.recv(READ_BYTES)
                if not data:
                    ended = "the router closed it"
                    break
                state.received += data
                if len(data) < READ_BYTES:
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            ended = f"it broke ({exc})"
        inputs: list[SessionInput] = []
        messages, bad = self._messages(state)
        for message in messages:
            item = self._take(session, message)
            if item is not None:
                inputs.append(item)
        if bad is not None:
            ended = f"it sent a bad frame ({bad})"
        if ended is not None:
            inputs.append(self._end(session, ended))
        self.flush_messages()  # refusals
        return inputs

    @staticmethod
    def _messages(state: _Session) -> tuple[list[engine_pb2.SessionRequest], Exception | None]:
        """The whole frames received (the rest waits for more bytes), and what made a frame
        bad, if one was: the frames before it still count, nothing after it does."""
        payloads, bad = take_frames(state.received)
        messages = []
        try:
            for payload in payloads:
                messages.append(engine_pb2.SessionRequest.FromString(payload))
        except DecodeError as exc:
            state.received.clear()
            return messages, exc
        return messages, bad

    def _take(self, session: int, message: engine_pb2.SessionRequest) -> SessionInput | None:
        kind = message.WhichOneof("kind")
        if kind == "abort_request_id":
            request_id = message.abort_request_id
            # Answered even when it had ended already (the router cannot tell).
            self._abort_sessions.setdefault(request_id, collections.deque()).append(session)
            logger.info("%s: aborted by the router", request_id)
            return AbortRequests([request_id])
        if kind != "generate":
            return None
        request = message.generate
        request_id = request.request_id or f"eng-{uuid.uuid4().hex}"
        if self.draining is not None:
            # The router marks this engine down and sends the request elsewhere.
            self._refuse(session, request_id, grpc.StatusCode.UNAVAILABLE, self.draining)
            return None
        if self._running(request_id):
            already = f"request_id {request_id!r} is already running"
            self._refuse(session, request_id, grpc.StatusCode.ALREADY_EXISTS, already)
            return None
        try:
            sampling = sampling_from_proto(request.sampling, request.num_prior_output_tokens)
        except ValueError as exc:
            self._refuse(session, request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return None
        # The prompt and sampling are checked as the core takes the request, in turn (after an
        # abort sent before it): a refusal then is the request's error output.
        kv_params = kv_params_from_proto(request.kv_transfer_params)
        now = time.time()
        self._requests.setdefault(request_id, collections.deque()).append(
            _Request(session, {"front_received": now})
        )
        logger.info(
            "%s: queued (%d prompt tokens, remote KV: %s)",
            request_id,
            len(request.prompt_token_ids),
            bool(kv_params),
        )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=sampling,
            arrival_time=now,
            priority=request.priority,
            kv_transfer_params=kv_params,
        )

    def _running(self, request_id: str) -> bool:
        """Whether a session request of this id is running and not being aborted: each abort
        asked and not answered yet ends one of the id's requests, oldest first."""
        bound = self._requests.get(request_id)
        return bound is not None and len(bound) > len(self._abort_sessions.get(request_id, ()))

    def _refuse(self, session: int, request_id: str, code: grpc.StatusCode, text: str) -> None:
        logger.info("%s: refused (%s: %s)", request_id, code.name, text)
        state = self._sessions.get(session)
        if state is not None:
            self._message(state).errors.add(request_id=request_id, code=code.value[0], message=text)

    def take_lost(self) -> list[AbortRequests]:
        """The aborts of the requests of sessions dropped while writing to them (a router gone,
        or one that stopped reading), for the core's loop."""
        lost, self._lost = self._lost, []
        return [self._end(session, why) for session, why in lost]

    def _end(self, session: int, why: str) -> AbortRequests:
        """Drop ``session``; its requests still running (and not being aborted) are aborted."""
        state = self._sessions.get(session)
        if state is not None:
            self._drop(session, state)
        left = [
            request_id
            for request_id, bound in self._requests.items()
            if any(r.session == session for r in bound) and self._running(request_id)
        ]
        if left:
            logger.info(
                "session %d ended (%s) with %d requests running, aborting: %s", session, why, len(left), left
            )
        return AbortRequests(left)

    def start_draining(self, message: str) -> None:
        """Refuse new requests with ``message`` (UNAVAILABLE) from now on, and close each session
        once nothing of it runs: the router then knows at once to go elsewhere."""
        self.draining = message
        for session in list(self._sessions):
            self._close_if_idle(session)

    # ------------------------------------------------------------------ from the core

    def route(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Put the outputs of session requests in their sessions' next frames (written by
        ``flush_messages``); return the others, which are the front's."""
        if not self._requests and not self._abort_sessions:
            return outputs
        front: list[EngineCoreOutput] = []
        ended: set[int] = set()
        for output in outputs:
            request_id = output.request_id
            if output.answers_abort:
                if output.finished:  # it was running: the request aborted ends here
                    ended.add(self._pop(request_id))
                asking = self._abort_sessions.get(request_id)
                if not asking:
                    front.append(output)  # the front's abort (its Abort RPC)
                    continue
                session = asking.popleft()
                if not asking:
                    del self._abort_sessions[request_id]
                state = self._sessions.get(session)
                if state is not None:
                    self._message(state).aborted.append(request_id)
                continue
            bound = self._requests.get(request_id)
            if bound is None:
                front.append(output)
                continue
            request = bound[0]
            if output.finished:
                ended.add(self._pop(request_id))
            state = self._sessions.get(request.session)
            if state is not None:
                message = self._message(state)
                if output.finish_reason == "error":
                    code, text = error_status(str(output.stop_reason))
                    message.errors.add(request_id=request_id, code=code.value[0], message=text)
                else:
                    timeline = output.timeline
                    if request.first_events:
                        timeline = {**request.first_events, **(timeline or {})}
                        request.first_events = None
                    message.outputs.add(**response_fields(output, timeline))
            if output.finished and output.finish_reason != "error":
                logger.info("%s: finished (%s)", request_id, output.finish_reason)
        if self.draining is not None:
            for session in ended:
                self._close_if_idle(session)
        return front

    def flush_messages(self) -> None:
        """Write each session's filled message as a frame."""
        for session, state in list(self._sessions.items()):
            if state.message is not None:
                self._write(session, state)

    def flush_pending(self) -> None:
        """Write what the routers could not take before."""
        for session, state in list(self._sessions.items()):
            if state.pending:
                self._write(session, state)

    def close_all(self) -> None:
        for session, state in list(self._sessions.items()):
            if state.message is not None or state.pending:
                self._write(session, state)  # what is left, if the router takes it now
            self._drop(session, state)

    # ------------------------------------------------------------------ plumbing

    def _pop(self, request_id: str) -> int:
        """Forget the oldest request of ``request_id``; its session (-1: none)."""
        bound = self._requests.get(request_id)
        if not bound:
            return -1
        session = bound.popleft().session
        if not bound:
            del self._requests[request_id]
        return session

    def _close_if_idle(self, session: int) -> None:
        """While draining: close ``session`` once none of its requests runs."""
        state = self._sessions.get(session)
        if state is None or any(r.session == session for bound in self._requests.values() for r in bound):
            return
        if state.message is not None or state.pending:
            self._write(session, state)
        if self._sessions.get(session) is state:
            logger.info("session %d: nothing left running while draining; closing it", session)
            self._drop(session, state)

    @staticmethod
    def _message(state: _Session) -> engine_pb2.SessionResponse:
        if state.message is None:
            state.message = engine_pb2.SessionResponse()
        return state.message

    def _write(self, session: int, state: _Session) -> None:
        if state.message is not None:
            state.pending += frame(state.message.SerializeToString())
            state.message = None
        try:
            while state.pending:
                sent = state.connection.send(state.pending)
                del state.pending[:sent]
        except (BlockingIOError, InterruptedError):
            if len(state.pending) > MAX_PENDING_BYTES:
                logger.warning(
                    "session %d: the router took nothing of %d bytes; closing it", session, len(state.pending)
                )
                self._drop(session, state)
                self._lost.append((session, "the router read nothing"))
        except OSError as exc:  # the router went away
            logger.info("session %d: the router's connection is gone (%s)", session, exc)
            self._drop(session, state)
            self._lost.append((session, f"it broke ({exc})"))

    def _drop(self, session: int, state: _Session) -> None:
        self._sessions.pop(session, None)
        self._by_fd.pop(state.connection.fileno(), None)
        state.pending.clear()
        state.connection.close()
