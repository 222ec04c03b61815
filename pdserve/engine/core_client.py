"""Front-side handles on an engine core process: start it, send requests, read outputs.

The front binds two ZMQ IPC sockets in a private temporary directory and starts the core as a
subprocess. Its configuration (which may hold the cluster token) goes to the child's stdin, not
its command line, so ``ps`` does not show it; only the typed messages of ``messages`` cross
the sockets.

As in vLLM's ``v1/engine/core_client.py``: ``MPClient`` owns the process, the sockets, the
messages sent and the handling of every message the core sends back; ``EngineCoreClient``
(blocking: tests, scripts) and ``AsyncEngineCoreClient`` (asyncio: the gRPC engine servers)
add only how they wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar, cast

import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.engine import messages
from pdserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pdserve.engine.request import SamplingParams
from pdserve.engine.session_stream import hand_over

logger = logging.getLogger(__name__)

# What ``_send`` returns: None for the blocking client, a coroutine to await for the asyncio one.
_Sent = TypeVar("_Sent")


class EngineCoreError(RuntimeError):
    """The core process died or did not start."""


def spawn_core(
    config: EngineConfig,
    inputs: zmq.Socket,
    outputs: zmq.Socket,
    env: dict[str, str] | None = None,
    log_level: str = "INFO",
    session_channel: socket.socket | None = None,
) -> tuple[str, subprocess.Popen]:
    """Bind ``inputs``/``outputs`` to IPC paths in a private directory and start the core there.

    The configuration (which may hold the cluster token) goes through the child's stdin, not its
    command line, so ``ps`` does not show it. ``session_channel``: the core's end of the Unix
    socket the front hands framed sessions over on (``core_sessions``).
    """
    ipc_dir = tempfile.mkdtemp(prefix="pdserve-core-")
    input_addr, output_addr = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    inputs.bind(input_addr)
    outputs.bind(output_addr)
    channel = [] if session_channel is None else ["--session-channel", str(session_channel.fileno())]
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve.engine.core_proc",
            "--input", input_addr,
            "--output", output_addr,
            "--log-level", log_level,
            "--parent-pid", str(os.getpid()),
            *channel,
        ],
        env={**os.environ, **(env or {})},
        stdin=subprocess.PIPE,
        pass_fds=() if session_channel is None else (session_channel.fileno(),),
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(config.to_json().encode())
    proc.stdin.close()
    return ipc_dir, proc


class MPClient(Generic[_Sent]):
    """One engine core process and the two sockets to it (front -> core, core -> front).

    ``info`` is None until the core reports READY (model loaded). Every message from the core
    goes through ``_dispatch``, which hands outputs and replies to the subclass's hooks.
    """

    def __init__(
        self, config: EngineConfig, ctx: zmq.Context, env: dict[str, str] | None, log_level: str
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.inputs = ctx.socket(zmq.PUSH)
        self.outputs = ctx.socket(zmq.PULL)
        # One end each: the front hands framed sessions' sockets to the core on it.
        self.session_channel, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._ipc_dir, self.proc = spawn_core(
                config, self.inputs, self.outputs, env, log_level, session_channel=core_end
            )
        finally:
            core_end.close()
        self._nonces = itertools.count()
        self._sessions = itertools.count(1)
        self.info: messages.CoreInfo | None = None

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> _Sent:
        """Start a request; its outputs come to this client."""
        return self._send(
            messages.AddRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=sampling_params,
                kv_transfer_params=kv_transfer_params,
                priority=priority,
                arrival_time=time.time(),
            )
        )

    def abort(self, request_ids: list[str]) -> _Sent:
        return self._send(messages.Abort(list(request_ids)))

    def open_session(self, connection: socket.socket) -> int:
        """Hand a router's framed session to the core, which reads and writes it from then on
        (``core_sessions``); the caller closes its own copy of ``connection``."""
        session = next(self._sessions)
        hand_over(self.session_channel, session, connection)
        return session

    def start_draining(self, message: str) -> _Sent:
        """Have the core refuse its framed sessions' new requests (UNAVAILABLE, ``message``)
        and close each session once nothing of it runs."""
        return self._send(messages.Drain(message))

    def _query(self, query_type: type[messages.Query]) -> messages.Query:
        """A query the core answers with a reply carrying the same nonce."""
        return query_type(nonce=next(self._nonces))

    # ------------------------------------------------------------------ what the core sends

    def _dispatch(self, data: bytes) -> None:
        """Decode one message from the core (ValueError if malformed) and hand it on."""
        message = messages.decode_from_core(data)
        if isinstance(message, messages.Outputs):
            self._on_outputs(message.outputs)
        elif isinstance(message, messages.Ready):
            self.info = message.info
            self._on_ready()
        else:
            self._on_reply(message)

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        raise NotImplementedError

    def _on_reply(self, reply: messages.Reply) -> None:
        raise NotImplementedError

    def _on_ready(self) -> None:
        pass

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: messages.FrontMessage) -> _Sent:
        raise NotImplementedError

    def _exit_error(self) -> EngineCoreError | None:
        """The error to raise if the core process has exited, else None."""
        code = self.proc.poll()
        if code is None:
            return None
        during = "" if self.info is not None else " during start-up"
        return EngineCoreError(f"engine core exited with code {code}{during}")

    def _shutdown_message(self) -> bytes:
        return messages.encode(messages.Shutdown())

    def _release(self) -> None:
        """Kill the core if it is still running; close the sockets and the IPC directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.ctx.closed:
            return
        self.session_channel.close()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class EngineCoreClient(MPClient[None]):
    """Blocking client (tests, scripts): each call reads the core's messages until it has its answer.

    Outputs read while waiting for something else (a reply, another request) are kept for the
    next ``get_outputs``.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        log_level: str = "INFO",
    ) -> None:
        super().__init__(config, zmq.Context(), env, log_level)
        self._buffered: list[EngineCoreOutput] = []
        self._replies: dict[int, messages.Reply | None] = {}  # {nonce: reply, None until it arrives}
        try:
            if not self._read_until(lambda: self.info is not None, startup_timeout_s):
                raise EngineCoreError(f"engine core not ready after {startup_timeout_s:.0f}s")
        except EngineCoreError:
            self.close()
            raise

    # ------------------------------------------------------------------ requests

    def get_outputs(self, timeout_s: float | None = None) -> list[EngineCoreOutput]:
        """Outputs that arrived, waiting up to ``timeout_s`` for the first (None: forever)."""
        wait_ms = -1 if timeout_s is None else int(timeout_s * 1000)
        if self._buffered:
            wait_ms = 0
        while self._read(wait_ms):
            wait_ms = 0
        outputs, self._buffered = self._buffered, []
        if not outputs:
            self._check_alive()
        return outputs

    def call(self, query_type: type[messages.Query], timeout_s: float = 10.0) -> messages.Reply:
        """Send a query and wait for its reply; outputs that arrive meanwhile are kept."""
        query = self._query(query_type)
        self._replies[query.nonce] = None
        try:
            self._send(query)
            if not self._read_until(lambda: self._replies[query.nonce] is not None, timeout_s):
                raise EngineCoreError(f"no reply to {query.TYPE!r} within {timeout_s}s")
            reply = self._replies[query.nonce]
            assert reply is not None
            return reply
        finally:
            del self._replies[query.nonce]

    def stats(self) -> dict[str, Any]:
        """Every ``SchedulerStats`` field by name (a field that does not exist is a KeyError)."""
        reply = self.call(messages.StatsQuery)
        assert isinstance(reply, messages.StatsReply)
        return dataclasses.asdict(reply.stats)

    def reset_prefix_cache(self) -> bool:
        reply = self.call(messages.ResetPrefixCache)
        assert isinstance(reply, messages.ResetPrefixCacheReply)
        return reply.ok

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> EngineCoreOutput:
        """Blocking convenience for tests: one request to completion, outputs merged."""
        self.add_request(request_id, prompt_token_ids, sampling_params, kv_transfer_params)
        merged = EngineCoreOutput(request_id=request_id, new_token_ids=[])
        deadline = time.monotonic() + timeout_s
        others: list[EngineCoreOutput] = []
        while time.monotonic() < deadline:
            for output in self.get_outputs(timeout_s=0.1):
                if output.request_id != request_id:
                    others.append(output)
                    continue
                merged.new_token_ids.extend(output.new_token_ids)
                if output.finished:
                    merged.finish_reason = output.finish_reason
                    merged.kv_transfer_params = output.kv_transfer_params
                    merged.stop_reason = output.stop_reason
                    merged.num_cached_tokens = output.num_cached_tokens
                    self._buffered.extend(others)
                    return merged
        self._buffered.extend(others)
        raise TimeoutError(f"request {request_id} did not finish within {timeout_s}s")

    # ------------------------------------------------------------------ plumbing

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        # An abort's empty answer (the request was not running) tells a caller nothing.
        self._buffered.extend(o for o in outputs if o.finished or not o.answers_abort)

    def _on_reply(self, reply: messages.Reply) -> None:
        if reply.nonce in self._replies:  # else a reply to a call that timed out
            self._replies[reply.nonce] = reply

    def _read(self, timeout_ms: int) -> bool:
        """Dispatch one message from the core if one comes within ``timeout_ms`` (-1: forever)."""
        if not self.outputs.poll(timeout_ms):
            return False
        self._dispatch(self.outputs.recv())
        return True

    def _read_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Read until ``done()``; False after ``timeout_s``; EngineCoreError if the core exits."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            if not self._read(100):
                self._check_alive()
        return True

    def _send(self, message: messages.FrontMessage) -> None:
        self._check_alive()
        self.inputs.send(messages.encode(message))

    def _check_alive(self) -> None:
        error = self._exit_error()
        if error is not None:
            raise error

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                self.inputs.send(self._shutdown_message(), zmq.NOBLOCK)
                self.proc.wait(timeout_s)
        self._release()

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OutputSink(Protocol):
    """Where a request's outputs go: an ``asyncio.Queue``, or anything with its ``put_nowait``."""

    def put_nowait(self, item: EngineCoreOutput, /) -> None: ...


class AsyncEngineCoreClient(MPClient[Coroutine[Any, Any, None]]):
    """asyncio client for the gRPC engine servers (``add_request`` and ``abort`` are awaited).

    One task reads the core's output socket and routes each output to the queue of the stream
    that asked for it, so any number of concurrent ``Generate`` calls share one core.
    """

    def __init__(
        self, config: EngineConfig, env: dict[str, str] | None = None, log_level: str = "INFO"
    ) -> None:
        super().__init__(config, zmq.asyncio.Context(), env, log_level)
        self._streams: dict[str, OutputSink] = {}  # {request_id: where its outputs go}
        # Which opening of an id a stream is, and for each id the openings its Aborts in flight
        # stopped (None: no stream was open), oldest first: the core answers each with one
        # ``answers_abort`` output, after every other output of the request it aborted.
        self._stream_numbers: dict[str, int] = {}
        self._aborts_in_flight: dict[str, collections.deque[int | None]] = {}
        self._openings = itertools.count()
        self._replies: dict[int, asyncio.Future[messages.Reply]] = {}  # {nonce: reply future}
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self.dead = False
        self.died = asyncio.Event()  # set with ``dead``: a waiter needs no polling

    async def start(self, timeout_s: float = 600.0) -> messages.CoreInfo:
        """Wait for the core's READY (model loaded); outputs are routed from then on."""
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_messages(), name="core-outputs")
        try:
            await asyncio.wait_for(self._ready, timeout_s)
        except TimeoutError:
            raise EngineCoreError(f"engine core not ready after {timeout_s:.0f}s") from None
        assert self.info is not None
        return self.info

    async def _read_messages(self) -> None:
        """Dispatch the core's messages as they arrive, and notice when the core dies.

        The output socket's FD sits in the loop's selector and each wake-up drains it with
        non-blocking receives, dispatching in the loop's callback: zmq.asyncio's poll and recv
        futures cost about 0.2 ms a message here, on every engine step. A zmq FD only says that
        something changed, so it is drained until nothing is left, and once at the start."""
        raw: zmq.Socket = zmq.Socket.shadow(self.outputs.underlying)
        fd = int(raw.getsockopt(zmq.FD))
        loop = asyncio.get_running_loop()

        def drain() -> None:
            # Asked before each receive: a receive that finds nothing raises zmq.Again, whose
            # making costs more than the question, once a step.
            while cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                try:
                    data = raw.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    self._dispatch(data)
                except ValueError as exc:
                    logger.error("bad message from engine core: %s", exc)

        loop.add_reader(fd, drain)
        try:
            drain()
            await self._core_exit()
            drain()  # what it sent before it exited
            self._on_core_death()
        finally:
            loop.remove_reader(fd)

    async def _core_exit(self) -> None:
        """Return when the core process has exited: told by its pidfd (no wake-up until then),
        or, where the kernel has none, seen by polling twice a second."""
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            while self.proc.poll() is None:
                await asyncio.sleep(0.5)
            return
        exited = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, exited.set)
        try:
            await exited.wait()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)

    def _on_core_death(self) -> None:
        """Fail every open stream and call: the core process exited under us."""
        self.dead = True
        self.died.set()
        error = self._exit_error()
        logger.error("%s", error)
        for request_id, queue in self._streams.items():
            queue.put_nowait(
                EngineCoreOutput(request_id, [], finish_reason="error", stop_reason="engine core died")
            )
        for future in [self._ready, *self._replies.values()]:
            if future is not None and not future.done():
                future.set_exception(error or EngineCoreError("engine core died"))

    # ------------------------------------------------------------------ requests

    def open_stream(self, request_id: str, sink: OutputSink) -> None:
        """Route ``request_id``'s outputs to ``sink`` (a Generate call's queue). A sink shared by
        many requests (a router's Session) gets each step's outputs in one call of the loop, one
        ``put_nowait`` each, with no await between them."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = sink
        self._stream_numbers[request_id] = next(self._openings)

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._stream_numbers.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> Coroutine[Any, Any, None]:
        """Abort in the core. Until the core answers, outputs of an id whose stream was closed
        (or reopened by a new request reusing the id) belong to the request aborted, and are
        dropped: the new request gets only its own."""
        self._track_aborts(request_ids)
        return super().abort(request_ids)

    async def abort_taken(self, request_ids: list[str], timeout_s: float = 10.0) -> None:
        """``abort``, returning once the core has taken it in: a request the caller's client
        sends afterwards on a framed session (which the core reads itself, not through this
        client, so in no order with it) cannot be the one this aborts."""
        self._track_aborts(request_ids)
        await self._ask(
            messages.AbortTaken(nonce=next(self._nonces), request_ids=list(request_ids)), timeout_s
        )

    def _track_aborts(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._aborts_in_flight.setdefault(request_id, collections.deque()).append(
                self._stream_numbers.get(request_id)
            )

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    async def call(self, query_type: type[messages.Query], timeout_s: float = 10.0) -> messages.Reply:
        return await self._ask(self._query(query_type), timeout_s)

    async def _ask(self, query: messages.Query | messages.AbortTaken, timeout_s: float) -> messages.Reply:
        future: asyncio.Future[messages.Reply] = asyncio.get_running_loop().create_future()
        self._replies[query.nonce] = future
        try:
            await self._send(query)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._replies.pop(query.nonce, None)

    async def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        reply = await self.call(messages.StatsQuery, timeout_s)
        assert isinstance(reply, messages.StatsReply)
        return reply.stats

    async def reset_prefix_cache(self) -> bool:
        reply = await self.call(messages.ResetPrefixCache)
        assert isinstance(reply, messages.ResetPrefixCacheReply)
        return reply.ok

    # ------------------------------------------------------------------ plumbing

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            request_id = output.request_id
            queue = self._streams.get(request_id)
            aborts = self._aborts_in_flight.get(request_id)
            if aborts:
                number = self._stream_numbers.get(request_id)
                if output.answers_abort:
                    aborted = aborts.popleft()
                    if not aborts:
                        del self._aborts_in_flight[request_id]
                    if aborted is None or aborted != number or not output.finished:
                        continue  # the answer for a stream closed before (or a request done)
                elif aborts[0] != number:
                    continue  # a late output of the aborted request, not the stream open now
            elif output.answers_abort and not output.finished:
                continue
            if queue is not None:
                queue.put_nowait(output)

    def _on_reply(self, reply: messages.Reply) -> None:
        future = self._replies.pop(reply.nonce, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _on_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def _send(self, message: messages.FrontMessage) -> None:
        if self.dead or self.proc.poll() is not None:
            raise EngineCoreError("engine core is not running")
        await self.inputs.send(messages.encode(message))

    async def close(self, timeout_s: float = 10.0) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                await self.inputs.send(self._shutdown_message(), zmq.NOBLOCK)
                await asyncio.to_thread(self.proc.wait, timeout_s)
        self._release()
