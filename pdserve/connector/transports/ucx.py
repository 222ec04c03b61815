"""UCX through ``ucxx``: shared memory / CMA on one host, TCP (or RDMA) across hosts.

One UCX worker per transport, driven by one thread that owns it (no asyncio, no ucxx progress
or notifier threads): it sleeps in ``select`` on the worker's epoll fd and a wake-up pipe, and
makes progress, posts requests and checks completions itself. Going through ucxx's asyncio
layer instead costs three thread hand-offs per message (progress thread -> notifier thread ->
event loop), which measured ~1.5 ms for a one-block read here versus ~0.12 ms this way.

Endpoints are made from worker addresses with endpoint error handling OFF: with it on, UCX
drops the shared-memory transports (they cannot detect a dead peer) and falls back to TCP.
The cost is that a dead peer is only noticed by our deadline, which is why every read has one.

Protocol (tag messages; control tag has the top bit set, data tags never do)::

    reader -> server  CONTROL_TAG  {"op": "hello", "client": nonce, "reader", "address": worker address}
    reader -> server  CONTROL_TAG  {"op": "read", "client": nonce, "tid", "reader", "tag": T,
                                    "runs": [[start, count], ...]}
    server -> reader  tag T+1+i    the bytes of run i, sent from and received into the caches
    server -> reader  tag T        only if it refuses: {"ok": false, "error": str}

The reader posts its receives (one per run, straight into its destination blocks, and one
for a refusal) before it sends the request; a successful read costs no extra message. On a missed deadline it closes the endpoint to that peer, which
cancels every receive posted on it, then reports each of that peer's reads failed; the next
read reconnects with a fresh nonce.

UCX settings: none are required. ``ucxx`` sets a few ``UCX_*`` defaults in ``os.environ`` when
imported (``UCX_RNDV_THRESH=8192`` etc.); this module undoes that so they cannot leak into NIXL's
own UCX in the same or a child process, and hands UCX options explicitly via ``ucx_options``
(e.g. ``{"TLS": "tcp"}`` to force TCP). Set ``UCX_WARN_UNUSED_ENV_VARS=n`` to silence UCX's
warning about ``UCX_MEMTYPE_CACHE`` if it is in your environment.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import msgpack

from pdserve.connector.transports.base import KVTransport, ReadJob, RemotePeer, kv_bytes
from pdserve.wake_pipe import WakePipe

logger = logging.getLogger(__name__)

CONTROL_TAG = (1 << 63) | 0x7064_6B76  # "pdkv"
_CONTROL_BYTES = 1 << 20  # a read message of up to ~100k separate runs
_STATUS_BYTES = 512
_LEN = struct.Struct("<I")
_MAX_SLEEP_S = 0.05  # a cap on select() so a missed UCX event costs latency, never a hang


def _import_ucxx() -> Any:
    """ucxx's low-level API, imported without leaving ucxx's ``UCX_*`` defaults in os.environ."""
    before = set(os.environ)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array
    finally:
        for key in set(os.environ) - before:
            del os.environ[key]
    return SimpleNamespace(
        Array=Array,
        Feature=libucxx.Feature,
        UCXAddress=libucxx.UCXAddress,
        UCXContext=libucxx.UCXContext,
        UCXEndpoint=libucxx.UCXEndpoint,
        UCXWorker=libucxx.UCXWorker,
        UCXXTag=libucxx.UCXXTag,
        UCXXTagMaskFull=libucxx.UCXXTagMaskFull,
    )


def probe_ucx() -> str | None:
    """None if ucxx imports and can build a worker here."""
    ucx_api = _import_ucxx()
    context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    ucx_api.UCXWorker(context)
    return None


@dataclass
class _Peer:
    """Reader side: a server we read from, and our endpoint to it (None until first used)."""

    engine_id: str
    address: bytes
    endpoint: Any = None
    nonce: int = 0
    reads: set[str] = field(default_factory=set)  # transfer ids in flight to this peer
    keep: list[Any] = field(default_factory=list)  # hello request + buffer, kept until done


@dataclass
class _Read:
    """Reader side: one read's posted requests (kept alive: dropping a ucxx request cancels it)."""

    job: ReadJob
    peer: _Peer
    status_buf: bytearray
    status_req: Any
    data_reqs: list[Any]
    request_req: Any
    request_buf: bytes


@dataclass
class _Serve:
    """Server side: the sends answering one read."""

    transfer_id: str
    reader: str
    client: int
    deadline: float
    requests: list[Any]
    buffers: list[Any]
    report: bool  # False for a refusal: only its status message goes out


class UcxTransport(KVTransport):
    """KV block reads over UCX tag messages; see the module docstring."""

    name = "ucx"

    def __init__(self, kv_cache: Any, *, ucx_options: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(kv_cache, **kwargs)
        api = self._api = _import_ucxx()
        self._view = kv_bytes(kv_cache)
        self._context = api.UCXContext(
            config_dict=dict(ucx_options or {}), feature_flags=(api.Feature.TAG, api.Feature.WAKEUP)
        )
        self._worker = api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        # Data tags: a random 31-bit prefix per transport and a 32-bit counter.
        self._tag_prefix = secrets.randbits(31) << 32
        self._tag_counter = 0
        self._waker = WakePipe()
        self._commands: deque[tuple[Any, ...]] = deque()  # from the engine thread to the worker thread
        # Worker-thread state.
        self._peers: dict[str, _Peer] = {}  # {engine_id: peer}
        self._reads: dict[str, _Read] = {}  # {transfer_id: read}
        self._clients: dict[int, Any] = {}  # {client nonce: endpoint}, server side
        self._client_readers: dict[int, str] = {}  # {client nonce: reader engine id}
        self._serves: list[_Serve] = []
        self._control_buf = bytearray(_CONTROL_BYTES)
        self._control_req: Any = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pdserve-ucx-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine-thread side

    def _transport_metadata(self) -> dict[str, Any]:
        return {"address": self._address} if self.role.serves else {}

    def _add_remote(self, peer: RemotePeer) -> None:
        address = peer.metadata.get("address")
        if not isinstance(address, bytes) or not address:
            raise ValueError(
                f"peer {peer.engine_id} does not serve ucx reads (no worker address in its metadata)"
            )
        self._command("add", peer.engine_id, address)

    def _remove_remote(self, engine_id: str) -> None:
        self._command("remove", engine_id)

    def _start_read(self, job: ReadJob) -> None:
        if not self._thread.is_alive():
            self._finish(job, "ucx worker thread is not running")
            return
        self._command("read", job)

    def _close(self) -> None:
        self._command("stop")
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # pragma: no cover
            logger.error("ucx worker thread did not stop")
            return
        self._waker.close()

    def _command(self, *command: Any) -> None:
        self._commands.append(command)
        self._waker.wake()

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        worker = self._worker
        wake_fds = [worker.epoll_file_descriptor, self._waker]
        try:
            if self.role.serves:
                self._post_control_recv()
            while not self._stopping:
                self._run_commands()
                worker.progress()
                self._check_control()
                self._check_reads()
                self._check_serves()
                self._expire()
                if self._commands or self._stopping:
                    continue
                if worker.arm():  # nothing pending inside UCX: safe to sleep on its fd
                    ready, _, _ = select.select(wake_fds, [], [], self._sleep_time())
                    if self._waker in ready:
                        self._waker.drain()
        except Exception:
            logger.exception("ucx worker thread crashed")
        finally:
            self._shutdown()

    def _run_commands(self) -> None:
        while self._commands:
            kind, *args = self._commands.popleft()
            if kind == "read":
                try:
                    self._post_read(args[0])
                except Exception as exc:  # e.g. a peer address UCX cannot reach
                    logger.exception("ucx: could not start read %s", args[0].transfer_id)
                    self._finish(args[0], f"could not start: {exc}")
            elif kind == "add":
                engine_id, address = args
                old = self._peers.get(engine_id)
                if old is not None:
                    self._reset_peer(old, "peer replaced")
                self._peers[engine_id] = _Peer(engine_id, address)
            elif kind == "remove":
                peer = self._peers.pop(args[0], None)
                if peer is not None:
                    self._reset_peer(peer, "peer removed")
            elif kind == "stop":
                self._stopping = True

    def _sleep_time(self) -> float:
        now = time.perf_counter()
        deadlines = [r.job.deadline for r in self._reads.values()] + [s.deadline for s in self._serves]
        return max(0.0, min([_MAX_SLEEP_S, *(d - now for d in deadlines)]))

    # -- reader side

    def _post_read(self, job: ReadJob) -> None:
        api = self._api
        peer = self._peers.get(job.engine_id)
        if peer is None:
            self._finish(job, f"unknown remote engine {job.engine_id!r}")
            return
        first_tag = self._take_tags(len(job.runs) + 1)
        if peer.endpoint is None:
            self._connect(peer)
        request_buf = _frame(
            {
                "op": "read",
                "client": peer.nonce,
                "tid": job.transfer_id,
                "reader": self.engine_id,
                "tag": first_tag,
                "runs": [[run.remote_start, run.count] for run in job.runs],
            }
        )
        if len(request_buf) > _CONTROL_BYTES:
            self._finish(job, f"a read of {len(job.runs)} separate runs is too large for one request")
            return
        endpoint, bpb = peer.endpoint, self.bytes_per_block
        # Receives first, straight into the destination blocks, then the request.
        status_buf = bytearray(_STATUS_BYTES)
        status_req = endpoint.tag_recv(api.Array(status_buf), api.UCXXTag(first_tag), api.UCXXTagMaskFull)
        data_reqs = []
        for i, run in enumerate(job.runs):
            view = self._view[run.local_start * bpb : (run.local_start + run.count) * bpb]
            data_reqs.append(
                endpoint.tag_recv(api.Array(view), api.UCXXTag(first_tag + 1 + i), api.UCXXTagMaskFull)
            )
        request_req = endpoint.tag_send(api.Array(request_buf), api.UCXXTag(CONTROL_TAG))
        self._reads[job.transfer_id] = _Read(
            job, peer, status_buf, status_req, data_reqs, request_req, request_buf
        )
        peer.reads.add(job.transfer_id)

    def _connect(self, peer: _Peer) -> None:
        api = self._api
        address = api.UCXAddress.create_from_buffer(peer.address)
        peer.endpoint = api.UCXEndpoint.create_from_worker_address(self._worker, address, False)
        peer.nonce = secrets.randbits(62)
        hello = _frame(
            {"op": "hello", "client": peer.nonce, "reader": self.engine_id, "address": self._address}
        )
        peer.keep = [hello, peer.endpoint.tag_send(api.Array(hello), api.UCXXTag(CONTROL_TAG))]

    def _take_tags(self, count: int) -> int:
        if self._tag_counter + count >= 1 << 32:
            self._tag_counter = 0
        first = self._tag_prefix | self._tag_counter
        self._tag_counter += count
        return first

    def _check_reads(self) -> None:
        for read in list(self._reads.values()):
            if read.status_req.completed:
                # Only a refusal comes on the status tag, and no data follows it.
                error = _request_error(read.status_req) or _status_error(read.status_buf)
                self._end_read(read, error)
                continue
            if not all(req.completed for req in read.data_reqs):
                continue
            errors = [e for e in map(_request_error, [*read.data_reqs, read.request_req]) if e]
            self._end_read(read, errors[0] if errors else None)

    def _end_read(self, read: _Read, error: str | None) -> None:
        del self._reads[read.job.transfer_id]
        read.peer.reads.discard(read.job.transfer_id)
        # Dropping a ucxx request cancels it if it is still posted: the unused status receive
        # of a successful read, or the data receives of a refused one.
        read.data_reqs.clear()
        read.status_req = None
        self._finish(read.job, error)

    def _expire(self) -> None:
        now = time.perf_counter()
        late_peers = {id(r.peer): r.peer for r in self._reads.values() if r.job.deadline <= now}
        for peer in late_peers.values():
            self._reset_peer(peer, "timed out (peer stalled or gone)")
        for serve in [s for s in self._serves if s.deadline <= now]:
            logger.warning(
                "ucx: reader %s did not take transfer %s in time; dropping it",
                serve.reader,
                serve.transfer_id,
            )
            self._drop_client(serve.client)

    def _reset_peer(self, peer: _Peer, reason: str) -> None:
        """Close the endpoint (cancelling its receives), then fail every read in flight to it."""
        reads = [self._reads[tid] for tid in peer.reads]
        if peer.endpoint is not None:
            peer.endpoint.close_blocking(period=10**8, max_attempts=1)
            deadline = time.perf_counter() + 1.0
            pending = [req for r in reads for req in (r.status_req, *r.data_reqs)]
            while not all(req.completed for req in pending) and time.perf_counter() < deadline:
                self._worker.progress()
        peer.endpoint, peer.keep = None, []
        for read in reads:
            self._end_read(read, reason)

    # -- server side

    def _post_control_recv(self) -> None:
        api = self._api
        self._control_req = self._worker.tag_recv(api.Array(self._control_buf), api.UCXXTag(CONTROL_TAG))

    def _check_control(self) -> None:
        while self._control_req is not None and self._control_req.completed:
            error = _request_error(self._control_req)
            message = None if error else _parse_frame(self._control_buf)
            self._post_control_recv()
            if message is None:
                logger.warning("ucx: dropped a malformed control message (%s)", error or "bad frame")
                continue
            try:
                self._on_control(message)
            except Exception as exc:  # a bad peer message must not stop the worker thread
                logger.warning("ucx: bad control message %s: %s", message.get("op"), exc)

    def _on_control(self, message: dict[str, Any]) -> None:
        api = self._api
        # The client's nonce is an int on the wire (one left out is an unknown client, None).
        op, client = message.get("op"), cast(int, message.get("client"))
        if op == "hello":
            # A reader reconnects (new nonce) after it reset its endpoint: drop the old one.
            reader = str(message.get("reader", ""))
            for old in [c for c, r in self._client_readers.items() if r == reader and reader]:
                self._drop_client(old)
            address = api.UCXAddress.create_from_buffer(bytes(message["address"]))
            self._clients[client] = api.UCXEndpoint.create_from_worker_address(self._worker, address, False)
            self._client_readers[client] = reader
            return
        if op != "read":
            raise ValueError(f"unknown op {op!r}")
        endpoint = self._clients.get(client)
        if endpoint is None:
            raise ValueError(f"read from unknown client {client!r} (no hello)")
        tid, reader, tag = message["tid"], str(message.get("reader", "")), int(message["tag"])
        try:
            runs = self._check_served_runs(message.get("runs"))
        except ValueError as exc:  # refused: only a status message, on tag T
            buffers: list[Any] = [_frame({"ok": False, "error": str(exc)[: _STATUS_BYTES - 64]})]
            first, report = tag, False
        else:  # run i on tag T+1+i, nothing on T
            bpb = self.bytes_per_block
            buffers = [self._view[s * bpb : (s + n) * bpb] for s, n in runs]
            first, report = tag + 1, True
        requests = [
            endpoint.tag_send(api.Array(buf), api.UCXXTag(first + i)) for i, buf in enumerate(buffers)
        ]
        deadline = time.perf_counter() + self.transfer_timeout_s
        self._serves.append(_Serve(tid, reader, client, deadline, requests, buffers, report=report))

    def _check_serves(self) -> None:
        still = []
        for serve in self._serves:
            if not all(req.completed for req in serve.requests):
                still.append(serve)
                continue
            errors = [e for e in map(_request_error, serve.requests) if e]
            if errors:
                logger.warning("ucx: serving %s to %s failed: %s", serve.transfer_id, serve.reader, errors[0])
            elif serve.report:
                self._report_served(serve.transfer_id, serve.reader)
        self._serves = still

    def _drop_client(self, client: int) -> None:
        # A reader that reconnects (new hello) may do so in the same progress round that
        # completed its last sends: report those before its serves are forgotten, or the
        # prefill side holds their blocks until the lease expires.
        self._check_serves()
        endpoint = self._clients.pop(client, None)
        self._client_readers.pop(client, None)
        if endpoint is not None:
            endpoint.close_blocking(period=10**8, max_attempts=1)
        self._serves = [s for s in self._serves if s.client != client]

    # -- shutdown

    def _shutdown(self) -> None:
        for peer in list(self._peers.values()):
            self._reset_peer(peer, "transport closed")
        for client in list(self._clients):
            self._drop_client(client)
        self._control_req = None
        self._peers.clear()
        self._worker.progress()


def _frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message)
    return _LEN.pack(len(body)) + body


def _parse_frame(buf: bytearray) -> dict[str, Any] | None:
    (length,) = _LEN.unpack_from(buf)
    if length > len(buf) - _LEN.size:
        return None
    try:
        message = msgpack.unpackb(bytes(memoryview(buf)[_LEN.size : _LEN.size + length]), raw=False)
    except Exception:  # msgpack raises several types for malformed input
        return None
    return message if isinstance(message, dict) else None


def _status_error(buf: bytearray) -> str:
    status = _parse_frame(buf)
    if status is None:
        return "malformed refusal from server"
    return f"server refused: {status.get('error')}"


def _request_error(request: Any) -> str | None:
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises its own UCX error types
        return f"{type(exc).__name__}: {exc}"
    return None
