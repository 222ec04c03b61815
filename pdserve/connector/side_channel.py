"""The connector's side channel: handshake, lease renewals and releases, over ZMQ + msgpack.

The producer (prefill) binds a ROUTER socket served by one background thread; consumers
(decode) talk to it through DEALER sockets. Every frame is a msgpack map, optionally followed
by an HMAC-SHA256 of the map under the cluster token; with a token configured, a frame without
a valid, recent MAC is refused. Malformed frames get an error reply and never reach a handler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from pdserve.connector import auth
from pdserve.wake_pipe import WakePipe

logger = logging.getLogger(__name__)

# A signed message older (or newer) than this is refused: a captured frame can't be replayed later.
MAX_CLOCK_SKEW_S = 60.0


class SideChannelError(RuntimeError):
    """The peer refused us, answered garbage, or did not answer in time."""


def pack(message: dict[str, Any], token: str | None) -> list[bytes]:
    payload = msgpack.packb({**message, "ts": time.time()}, use_bin_type=True)
    return [payload, auth.sign(token, payload) if token else b""]


def unpack(frames: list[bytes], token: str | None) -> dict[str, Any]:
    """Verify and decode ``[payload, mac]``; ValueError says why a frame is refused."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    payload, mac = frames
    if token and not auth.verify(token, payload, mac):
        raise ValueError("authentication failed: bad or missing cluster token")
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=1 << 20)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueError(f"malformed message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("malformed message: expected a map with a string 'type'")
    if token:
        ts = message.get("ts")
        if not isinstance(ts, int | float) or abs(time.time() - ts) > MAX_CLOCK_SKEW_S:
            raise ValueError("authentication failed: stale or missing timestamp")
    return message


Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelServer:
    """ROUTER socket + thread; ``handlers[type](message) -> reply`` (a ValueError -> error reply)."""

    def __init__(self, host: str, port: int, handlers: dict[str, Handler], token: str | None = None) -> None:
        self.handlers = handlers
        self.token = token
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 << 20)  # a side-channel frame is small
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        # ``close`` wakes the thread through this; it otherwise sleeps until a message comes (a
        # 100 ms poll cost an idle prefill engine ~1.2 ms of CPU a second on a 2-core KVM guest).
        self._waker = WakePipe()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        while not self._stop.is_set():
            if self.socket not in dict(poller.poll()):
                continue  # woken by ``close``
            frames = self.socket.recv_multipart()
            identity, body = frames[0], frames[1:]
            reply = self._handle(body)
            try:
                self.socket.send_multipart([identity, *pack(reply, self.token)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("side channel: reply dropped: %s", exc)
        self.socket.close(linger=0)
        self.ctx.term()

    def _handle(self, body: list[bytes]) -> dict[str, Any]:
        nonce = None
        try:
            message = unpack(body, self.token)
            nonce = message.get("nonce")
            handler = self.handlers.get(message["type"])
            if handler is None:
                raise ValueError(f"unknown message type {message['type']!r}")
            reply = handler(message)
        except ValueError as exc:
            logger.warning("side channel: refused a message: %s", exc)
            reply = {"ok": False, "error": str(exc)}
        except Exception as exc:  # a handler bug must not kill the channel
            logger.exception("side channel: handler failed")
            reply = {"ok": False, "error": f"internal error: {exc}"}
        return {**reply, "type": "reply", "nonce": nonce}

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=2)
        self._waker.close()  # after the thread: it polls the pipe until it ends


class SideChannelClient:
    """One DEALER per remote engine. Not thread-safe: owned by the connector's transfer thread."""

    def __init__(self, host: str, port: int, token: str | None = None) -> None:
        self.token = token
        self.address = f"tcp://{host}:{port}"
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.address)
        self._nonce = itertools.count()

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send and wait for the matching reply; SideChannelError on refusal or timeout."""
        nonce = next(self._nonce)
        self.socket.send_multipart(pack({**message, "nonce": nonce}, self.token))
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(remaining * 1000) + 1):
                break
            try:
                reply = unpack(self.socket.recv_multipart(), self.token)
            except ValueError as exc:
                raise SideChannelError(f"{self.address}: bad reply: {exc}") from None
            if reply.get("nonce") != nonce:
                continue  # a late reply to an earlier notification
            if not reply.get("ok"):
                raise SideChannelError(f"{self.address}: {reply.get('error', 'refused')}")
            return reply
        raise SideChannelError(f"{self.address}: no reply to {message['type']!r} within {timeout_s}s")

    def notify(self, message: dict[str, Any]) -> None:
        """Fire and forget (release, renew): the reply, if any, is skipped by ``request``."""
        try:
            self.socket.send_multipart(pack({**message, "nonce": -1}, self.token), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel %s: notification dropped: %s", self.address, exc)

    def drain(self) -> None:
        """Discard replies to notifications so they don't pile up in the socket."""
        while self.socket.poll(0):
            self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(linger=0)
