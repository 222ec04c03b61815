"""Plain TCP: no extra dependency, works everywhere, the fallback when UCX/NIXL are missing.

Wire protocol (one persistent connection per reader -> server pair, reads one after another)::

    reader -> server   frame {"tid": str, "reader": str, "runs": [[start, count], ...]}
    server -> reader   frame {"tid": str, "ok": bool, "error": str | None, "nbytes": int}
                       then, if ok, the blocks' bytes in run order (nbytes of them)

With a cluster token, each new connection first proves it knows the token (challenge-response,
HMAC-SHA256) before any block is served::

    reader -> server   frame {"hello": true}
    server -> reader   frame {"ok": true, "challenge": hex}
    reader -> server   frame {"mac": HMAC(token, challenge)}
    server -> reader   frame {"ok": true}        (or {"ok": false, "error": ...} and close)

A frame is a 4-byte big-endian length and a msgpack map (never pickle). The server streams
straight out of its cache tensor (``sendmsg`` over memoryviews) and the reader ``recv_into``s
straight into its destination blocks: no staging copy on either side.

Deadlines: the reader's socket timeout is always the time left before the read's deadline, so a
stalled or dead server turns into a failed read by then; the connection is closed before the
failure is reported (nothing can write into those blocks afterwards) and the next read
reconnects. Reads on one connection run one at a time, so a failure never takes a queued read
down with it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.connector import auth
from pdserve.connector.transports.base import BlockRun, KVTransport, ReadJob, RemotePeer, kv_bytes

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_MAX_FRAME = 16 << 20  # a read of ~1M separate runs; anything bigger is a broken peer
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
DEFAULT_SOCKET_BUFFER = 4 << 20
AUTH_TIMEOUT_S = 10.0  # a connecting reader must finish the token handshake within this


@dataclass(frozen=True)
class TcpFault:
    """Test hook on the serving side: misbehave after ``after_bytes`` of a read's payload.

    ``stall`` stops sending for ``stall_s`` (forever by default: until the reader gives up or the
    transport closes); ``drop`` closes the connection. ``times`` limits how many served reads
    are hit (None: every one).
    """

    after_bytes: int = 0
    action: str = "stall"
    stall_s: float = math.inf
    times: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ("stall", "drop"):
            raise ValueError(f"TcpFault.action must be 'stall' or 'drop', got {self.action!r}")
        if self.after_bytes < 0 or not self.stall_s >= 0:
            raise ValueError("TcpFault.after_bytes and stall_s must be >= 0")


class TcpTransport(KVTransport):
    """KV block reads over TCP sockets; see the module docstring for the protocol."""

    name = "tcp"

    def __init__(
        self,
        kv_cache: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        connect_timeout_s: float = 5.0,
        socket_buffer_bytes: int | None = DEFAULT_SOCKET_BUFFER,
        fault: TcpFault | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(kv_cache, **kwargs)
        self._token = token or None  # the cluster token: readers must prove they know it
        self._view = kv_bytes(kv_cache)
        self._connect_timeout_s = connect_timeout_s
        self._socket_buffer_bytes = socket_buffer_bytes
        self._channels: dict[str, _TcpChannel] = {}  # {engine_id: channel}, reader side
        self._server: _TcpServer | None = None
        if self.role.serves:
            self._server = _TcpServer(self, host, port, fault)
            self._advertise = (advertise_host or host, self._server.port)

    @property
    def port(self) -> int | None:
        return self._server.port if self._server else None

    def _transport_metadata(self) -> dict[str, Any]:
        if self._server is None:
            return {}
        return {"host": self._advertise[0], "port": self._advertise[1]}

    def _add_remote(self, peer: RemotePeer) -> None:
        host, port = peer.metadata.get("host"), peer.metadata.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise ValueError(f"peer {peer.engine_id} does not serve tcp reads (no host/port in its metadata)")
        with self._cond:
            old = self._channels.pop(peer.engine_id, None)
            self._channels[peer.engine_id] = _TcpChannel(self, peer.engine_id, host, port)
        if old is not None:
            old.close("peer replaced")

    def _remove_remote(self, engine_id: str) -> None:
        with self._cond:
            channel = self._channels.pop(engine_id, None)
        if channel is not None:
            channel.close("peer removed")

    def _start_read(self, job: ReadJob) -> None:
        with self._cond:
            channel = self._channels.get(job.engine_id)
        if channel is None or not channel.submit(job):
            self._finish(job, f"no connection to {job.engine_id}")

    def _close(self) -> None:
        with self._cond:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close("transport closed")
        if self._server is not None:
            self._server.close()

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._socket_buffer_bytes:
            # Large explicit buffers let one sendmsg/recv_into move MBs per syscall; note an
            # explicit size turns off Linux autotuning and is capped by net.core.[rw]mem_max.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._socket_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._socket_buffer_bytes)


class _TcpChannel:
    """One reader -> server connection and the thread that runs its reads, oldest first."""

    def __init__(self, owner: TcpTransport, engine_id: str, host: str, port: int) -> None:
        self._owner = owner
        self._engine_id = engine_id
        self._address = (host, port)
        self._cond = threading.Condition()
        self._jobs: deque[ReadJob] = deque()
        self._sock: socket.socket | None = None
        self._closing: str | None = None  # why the channel is closing, once it is
        self._thread = threading.Thread(target=self._run, name=f"pdserve-tcp-read-{engine_id}", daemon=True)
        self._thread.start()

    def submit(self, job: ReadJob) -> bool:
        with self._cond:
            if self._closing:
                return False
            self._jobs.append(job)
            self._cond.notify()
        return True

    def close(self, reason: str) -> None:
        """Fail queued reads, abort the one on the wire, and wait until the thread has let go."""
        with self._cond:
            self._closing = reason
            sock = self._sock
            self._cond.notify()
        if sock is not None:
            _shutdown(sock)  # wakes a recv_into blocked on this socket
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # pragma: no cover - would be a bug in the read loop
            logger.error("tcp read thread for %s did not stop", self._engine_id)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if self._closing:
                    pending, self._jobs = list(self._jobs), deque()
                    break
                job = self._jobs.popleft()
            self._read(job)
        self._drop_socket()
        for job in pending:
            self._owner._finish(job, self._closing)

    def _read(self, job: ReadJob) -> None:
        owner = self._owner
        try:
            sock = self._connect(job)
            request = {"tid": job.transfer_id, "reader": owner.engine_id, "runs": _wire_runs(job.runs)}
            _send_buffers(sock, [_frame(request)], job.deadline)
            header = _recv_frame(sock, job.deadline)
            if header is None:
                raise ConnectionError("server closed the connection")
            if header.get("tid") != job.transfer_id:
                raise ValueError(
                    f"server answered transfer {header.get('tid')!r}, expected {job.transfer_id!r}"
                )
            if not header.get("ok"):
                error = f"server refused: {header.get('error')}"
                owner._finish(job, error)  # the connection is still in step: keep it
                return
            if header.get("nbytes") != job.nbytes:
                raise ValueError(f"server announced {header.get('nbytes')} bytes, expected {job.nbytes}")
            bpb = owner.bytes_per_block
            for run in job.runs:
                start = run.local_start * bpb
                _recv_into(sock, owner._view[start : start + run.count * bpb], job.deadline)
        except TimeoutError:
            self._drop_socket()
            owner._finish(job, self._closing or f"timed out after {time.perf_counter() - job.started:.3g}s")
        except (OSError, ValueError, EOFError) as exc:
            self._drop_socket()
            owner._finish(job, self._closing or f"connection to {self._engine_id} failed: {exc}")
        else:
            owner._finish(job, None)

    def _connect(self, job: ReadJob) -> socket.socket:
        if self._sock is not None:
            return self._sock
        timeout = min(self._owner._connect_timeout_s, job.remaining())
        if timeout <= 0:
            raise TimeoutError
        sock = socket.create_connection(self._address, timeout=timeout)
        self._owner._tune(sock)
        if self._owner._token:
            try:
                _authenticate(sock, self._owner._token, job.deadline)
            except BaseException:
                sock.close()
                raise
        with self._cond:
            if self._closing:
                sock.close()
                raise ConnectionError(self._closing)
            self._sock = sock
        return sock

    def _drop_socket(self) -> None:
        with self._cond:
            sock, self._sock = self._sock, None
        if sock is not None:
            _shutdown(sock)
            sock.close()


class _TcpServer:
    """Accepts readers and streams the blocks they ask for; one thread per connection."""

    def __init__(self, owner: TcpTransport, host: str, port: int, fault: TcpFault | None) -> None:
        self._owner = owner
        self._fault = fault
        self._faults_left = fault.times if fault is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._sock = socket.create_server((host, port), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="pdserve-tcp-accept", daemon=True
        )
        self._accept_thread.start()

    def close(self) -> None:
        self._stop.set()
        _shutdown(self._sock)  # wakes accept()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for conn in conns:
            _shutdown(conn)
        for thread in [self._accept_thread, *threads]:
            thread.join(timeout=5.0)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                logger.exception("tcp accept failed")
                time.sleep(0.05)
                continue
            self._owner._tune(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name="pdserve-tcp-serve", daemon=True
            )
            with self._lock:
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        owner = self._owner
        try:
            if owner._token and not _check_reader(conn, owner._token):
                logger.warning("tcp: refused a reader from %s without the cluster token", peer)
                return
            while not self._stop.is_set():
                conn.settimeout(None)  # idle between reads: wait as long as the reader likes
                request = _recv_frame(conn, None)
                if request is None:
                    return
                tid, reader = request.get("tid"), request.get("reader", "")
                deadline = time.perf_counter() + owner.transfer_timeout_s
                try:
                    if not isinstance(tid, str) or not isinstance(reader, str):
                        raise ValueError("tid and reader must be strings")
                    runs = owner._check_served_runs(request.get("runs"))
                except ValueError as exc:
                    _send_buffers(
                        conn, [_frame({"tid": tid, "ok": False, "error": str(exc), "nbytes": 0})], deadline
                    )
                    continue
                bpb = owner.bytes_per_block
                header = _frame(
                    {"tid": tid, "ok": True, "error": None, "nbytes": sum(n for _, n in runs) * bpb}
                )
                payload = [owner._view[s * bpb : (s + n) * bpb] for s, n in runs]
                if not self._send_payload(conn, header, payload, deadline):
                    return
                owner._report_served(tid, reader)
        except (OSError, ValueError, EOFError) as exc:
            if not self._stop.is_set():
                logger.debug("tcp connection from %s ended: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _send_payload(
        self, conn: socket.socket, header: bytes, payload: list[memoryview], deadline: float
    ) -> bool:
        """Send header + blocks; False if a fault dropped the connection or the server stops."""
        fault = self._take_fault()
        if fault is None:
            _send_buffers(conn, [header, *payload], deadline)
            return True
        head, tail = _split_buffers(payload, fault.after_bytes)
        _send_buffers(conn, [header, *head], deadline)
        if fault.action == "drop":
            _shutdown(conn)
            return False
        stall = None if math.isinf(fault.stall_s) else fault.stall_s
        if self._stop.wait(stall):
            return False
        _send_buffers(conn, tail, time.perf_counter() + self._owner.transfer_timeout_s)
        return True

    def _take_fault(self) -> TcpFault | None:
        with self._lock:
            if self._fault is None or self._faults_left == 0:
                return None
            if self._faults_left is not None:
                self._faults_left -= 1
            return self._fault


# ---------------------------------------------------------------------- socket helpers


def _authenticate(sock: socket.socket, token: str, deadline: float) -> None:
    """Reader side of the challenge-response; ConnectionError if the server refuses."""
    _send_buffers(sock, [_frame({"hello": True})], deadline)
    reply = _recv_frame(sock, deadline)
    if not reply or not reply.get("ok") or not isinstance(reply.get("challenge"), str):
        raise ConnectionError(
            f"server refused the handshake: {(reply or {}).get('error', 'connection closed')}"
        )
    _send_buffers(sock, [_frame({"mac": auth.sign(token, reply["challenge"].encode())})], deadline)
    reply = _recv_frame(sock, deadline)
    if not reply or not reply.get("ok"):
        raise ConnectionError(f"authentication failed: {(reply or {}).get('error', 'connection closed')}")


def _check_reader(conn: socket.socket, token: str) -> bool:
    """Server side: True once the reader has proved it knows the token (else it is told why)."""
    deadline = time.perf_counter() + AUTH_TIMEOUT_S
    hello = _recv_frame(conn, deadline)
    if hello is None:
        return False
    if hello.get("hello") is not True:
        refusal = {"tid": hello.get("tid"), "ok": False, "error": "authentication required", "nbytes": 0}
        _send_buffers(conn, [_frame(refusal)], deadline)
        return False
    challenge = os.urandom(16).hex()
    _send_buffers(conn, [_frame({"ok": True, "challenge": challenge})], deadline)
    answer = _recv_frame(conn, deadline)
    if not answer or not auth.verify(token, challenge.encode(), answer.get("mac")):
        _send_buffers(conn, [_frame({"ok": False, "error": "authentication failed"})], deadline)
        return False
    _send_buffers(conn, [_frame({"ok": True})], deadline)
    return True


def _wire_runs(runs: list[BlockRun]) -> list[list[int]]:
    return [[run.remote_start, run.count] for run in runs]


def _frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message)
    return _LEN.pack(len(body)) + body


def _arm(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        return
    left = deadline - time.perf_counter()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float | None) -> bytes | None:
    """``nbytes`` bytes, or None if the peer closed cleanly before sending any of them."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        _arm(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return None
            raise EOFError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float | None) -> dict[str, Any] | None:
    head = _recv_exact(sock, _LEN.size, deadline)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > _MAX_FRAME:
        raise ValueError(f"frame of {length} bytes is over the {_MAX_FRAME} limit")
    body = _recv_exact(sock, length, deadline)
    if body is None:
        raise EOFError("connection closed inside a frame")
    try:
        message = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ValueError(f"malformed frame: {exc}") from None
    if not isinstance(message, dict):
        raise ValueError("frame is not a map")
    return message


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got, total = 0, len(view)
    while got < total:
        _arm(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"connection closed after {got} of {total} payload bytes")
        got += n


def _send_buffers(sock: socket.socket, buffers: list[Any], deadline: float) -> None:
    """``sendall`` for a list of buffers: one ``sendmsg`` per batch, no concatenation."""
    pending = deque(memoryview(b).cast("B") for b in buffers if len(b))
    while pending:
        _arm(sock, deadline)
        sent = sock.sendmsg(list(pending)[:_IOV_MAX])
        while sent:
            first = pending[0]
            if sent >= len(first):
                sent -= len(first)
                pending.popleft()
            else:
                pending[0] = first[sent:]
                sent = 0


def _split_buffers(buffers: list[memoryview], nbytes: int) -> tuple[list[memoryview], list[memoryview]]:
    head: list[memoryview] = []
    tail: list[memoryview] = []
    for buf in buffers:
        if nbytes >= len(buf):
            head.append(buf)
            nbytes -= len(buf)
        elif nbytes > 0:
            head.append(buf[:nbytes])
            tail.append(buf[nbytes:])
            nbytes = 0
        else:
            tail.append(buf)
    return head, tail


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
