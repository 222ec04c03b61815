"""The one transport interface: move whole KV blocks from a peer engine's cache into ours.

Decode (the reader) pulls blocks that prefill (the server) holds. Every transport keeps the
same contract, so the connector above never knows which one it drives:

- The engine loop only *starts* reads and *polls* for results; the bytes move on a thread the
  transport owns (a socket thread, a UCX worker thread, a NIXL driver thread). Nothing here
  waits on the network on the caller's thread.
- Every read has a deadline. A read is reported FAILED at its deadline at the latest, and only
  once the transport has stopped writing into its local blocks (socket closed, UCX receives
  cancelled, NIXL request released): a reader may recompute into those blocks right away.
- A read moves whole blocks. The KV layout (``pdserve.engine.kv_layout``) keeps one block of all
  layers contiguous, so block ``b`` is the byte range ``[b * bytes_per_block, (b+1) *
  bytes_per_block)`` of the cache, and a run of consecutive blocks on both sides is one segment.

States are one small enum polled in one place (``poll``), as in SGLang's disaggregation code.
"""

from __future__ import annotations

import enum
import logging
import operator
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 10.0


class TransferState(enum.Enum):
    """Where a read is: in flight, or finished one way or the other."""

    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class TransportRole(enum.Enum):
    """Which side(s) of a read this engine plays: prefill serves, decode reads, or both."""

    PRODUCER = "producer"  # serves reads of its blocks (prefill)
    CONSUMER = "consumer"  # reads a peer's blocks into its own (decode)
    BOTH = "both"

    @property
    def serves(self) -> bool:
        return self is not TransportRole.CONSUMER

    @property
    def reads(self) -> bool:
        return self is not TransportRole.PRODUCER


@dataclass(frozen=True)
class TransferResult:
    """The end of one read started with ``start_read`` (reported once, by ``poll``)."""

    transfer_id: str
    ok: bool
    error: str | None
    nbytes: int
    seconds: float  # from start_read to the moment the reader's transport saw the end
    engine_id: str = ""  # the remote engine read from

    @property
    def state(self) -> TransferState:
        return TransferState.SUCCESS if self.ok else TransferState.FAILED


@dataclass(frozen=True)
class ServedRead:
    """A peer finished reading blocks from this engine: prefill may free them now."""

    transfer_id: str
    reader: str  # engine id of the reader


@dataclass(frozen=True)
class BlockRun:
    """``count`` consecutive remote blocks landing in ``count`` consecutive local blocks."""

    remote_start: int
    local_start: int
    count: int


def coalesce_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Pair block ids in order and merge runs contiguous on both sides into one segment.

    One segment is one NIXL descriptor, one UCX message, one ``recv_into``: a freshly allocated
    prompt usually coalesces to a handful of runs, whatever its length.
    """
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"remote_block_ids has {len(remote_block_ids)} blocks but local_block_ids has {len(local_block_ids)}"
        )
    runs: list[list[int]] = []  # [[remote_start, local_start, count], ...]
    for remote, local in zip(remote_block_ids, local_block_ids, strict=True):
        if runs:
            last = runs[-1]
            if last[0] + last[2] == remote and last[1] + last[2] == local:
                last[2] += 1
                continue
        runs.append([remote, local, 1])
    return [BlockRun(r, lo, n) for r, lo, n in runs]


def kv_bytes(kv_cache: torch.Tensor) -> memoryview:
    """The cache as one writable byte buffer sharing its memory (no copy), for sockets and UCX."""
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12; it is a buffer on 3.11 too.
    return memoryview(kv_cache.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


@dataclass
class ReadJob:
    """One read in flight, as the transport thread sees it (owned by that thread once queued)."""

    transfer_id: str
    engine_id: str
    runs: list[BlockRun]
    nbytes: int
    started: float  # time.perf_counter() at start_read
    deadline: float  # time.perf_counter() after which the read fails
    done: bool = False

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass
class RemotePeer:
    """What this engine knows about a peer's cache (from its ``local_metadata``)."""

    engine_id: str
    num_blocks: int
    bytes_per_block: int
    metadata: dict[str, Any] = field(repr=False)


class KVTransport(ABC):
    """Moves whole KV blocks between this engine's cache and its peers' caches.

    Thread model: the public methods may be called from any engine-side thread (they only
    take ``_cond`` briefly and queue work); the transport's own thread(s) move bytes and report
    through ``_finish`` / ``_report_served``. Do not spin on ``poll``: a Python thread that never
    releases the GIL starves the transport's threads (5 ms switch interval); block in ``wait``
    or on whatever the ``wakeup`` hook signals instead.

    Invariant: a transfer id is in ``_in_flight`` from ``start_read`` until its result is queued
    for ``poll``; once queued, the transport no longer touches the read's local blocks.
    """

    name: ClassVar[str]
    # The serving side's cache must be allocated in shared memory (``KVCacheSpec.allocate(...,
    # shared=True)``): the reader maps it instead of asking for it.
    needs_shared_cache: ClassVar[bool] = False
    # Whether the serving side learns of finished reads (``poll_served``).
    reports_served: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        role: TransportRole | str = TransportRole.BOTH,
        engine_id: str | None = None,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        wakeup: Callable[[], None] | None = None,
        spec: Any = None,
        track_served: bool = False,
    ) -> None:
        _check_cache(kv_cache, spec)
        if not transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s!r}")
        self.kv_cache = kv_cache
        self.num_blocks = int(kv_cache.shape[0])
        self.bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        self.role = TransportRole(role)
        self.engine_id = engine_id or f"kv-{uuid.uuid4().hex[:12]}"
        self.transfer_timeout_s = float(transfer_timeout_s)
        # Called from a transport thread whenever a result or served read is queued, so an idle
        # engine loop blocked on its poller can be woken (e.g. a write to a ZMQ/pipe socket).
        self._wakeup = wakeup
        # Keep the reads peers completed for ``poll_served``. Off unless asked for: the engines
        # free blocks on the side channel's ``release`` and never poll them, and a serving
        # engine that kept them would hold one entry a request for as long as it runs (and
        # the NIXL producer's driver would wake every few ms for as long as it runs).
        self.track_served = track_served
        self._cond = threading.Condition()
        self._results: deque[TransferResult] = deque()
        self._served: deque[ServedRead] = deque()
        self._in_flight: dict[str, ReadJob] = {}  # {transfer_id: job}
        self._remotes: dict[str, RemotePeer] = {}  # {engine_id: peer}
        self._closed = False

    # ------------------------------------------------------------------ public API

    def local_metadata(self) -> dict[str, Any]:
        """What a peer passes to ``add_remote`` to read from this engine (msgpack-able)."""
        return {
            "transport": self.name,
            "engine_id": self.engine_id,
            "num_blocks": self.num_blocks,
            "bytes_per_block": self.bytes_per_block,
            **self._transport_metadata(),
        }

    def add_remote(self, engine_id: str, metadata: dict[str, Any]) -> None:
        """Make a peer readable. Adding a known engine id with new metadata replaces it (a
        restarted peer: its reads in flight fail); with the same metadata it is a no-op, so a
        repeated handshake does not disturb reads in flight."""
        self._check_open()
        with self._cond:
            known = self._remotes.get(engine_id)
            if known is not None and known.metadata == metadata:
                return
        if not self.role.reads:
            raise ValueError(f"{self.name} transport in role {self.role.value} does not read from peers")
        if metadata.get("transport") != self.name:
            raise ValueError(
                f"peer {engine_id} speaks {metadata.get('transport')!r}, this engine {self.name!r}"
            )
        if metadata.get("bytes_per_block") != self.bytes_per_block:
            raise ValueError(
                f"peer {engine_id} has {metadata.get('bytes_per_block')} bytes per block, "
                f"this engine {self.bytes_per_block}: KV layouts differ"
            )
        num_blocks = metadata.get("num_blocks")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"peer {engine_id}: num_blocks must be a positive int, got {num_blocks!r}")
        peer = RemotePeer(engine_id, num_blocks, self.bytes_per_block, dict(metadata))
        self._add_remote(peer)
        with self._cond:
            self._remotes[engine_id] = peer

    def remove_remote(self, engine_id: str) -> None:
        """Forget a peer; its reads in flight fail (reported by ``poll``)."""
        with self._cond:
            known = self._remotes.pop(engine_id, None) is not None
        if known:
            self._remove_remote(engine_id)

    def has_remote(self, engine_id: str) -> bool:
        with self._cond:
            return engine_id in self._remotes

    def start_read(
        self,
        transfer_id: str,
        engine_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Start pulling ``remote_block_ids`` of ``engine_id`` into ``local_block_ids``; returns at once.

        Bad arguments raise ``ValueError`` here; everything that goes wrong later (peer gone,
        peer stalled, deadline) comes back from ``poll`` as a failed ``TransferResult``.
        """
        self._check_open()
        remote_ids = [_block_id(b, "remote_block_ids") for b in remote_block_ids]
        local_ids = [_block_id(b, "local_block_ids") for b in local_block_ids]
        runs = coalesce_runs(remote_ids, local_ids)
        timeout = self.transfer_timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if len(set(local_ids)) != len(local_ids):
            raise ValueError("local_block_ids has duplicates: two remote blocks cannot land in one block")
        if local_ids and (min(local_ids) < 0 or max(local_ids) >= self.num_blocks):
            raise ValueError(f"local_block_ids out of range [0, {self.num_blocks})")
        now = time.perf_counter()
        job = ReadJob(transfer_id, engine_id, runs, len(local_ids) * self.bytes_per_block, now, now + timeout)
        with self._cond:
            peer = self._remotes.get(engine_id)
            if peer is None:
                raise ValueError(f"unknown remote engine {engine_id!r}: add_remote() it first")
            if remote_ids and (min(remote_ids) < 0 or max(remote_ids) >= peer.num_blocks):
                raise ValueError(f"remote_block_ids out of range [0, {peer.num_blocks}) of {engine_id}")
            if transfer_id in self._in_flight:
                raise ValueError(f"transfer {transfer_id!r} is already in flight")
            self._in_flight[transfer_id] = job
        if not runs:
            self._finish(job, None)
            return
        try:
            self._start_read(job)
        except Exception as exc:  # reported like any failed read: the caller only polls
            logger.exception("%s: could not start read %s", self.name, transfer_id)
            self._finish(job, f"could not start: {exc}")

    def poll(self) -> list[TransferResult]:
        """Reads that ended since the last call (each reported once). Never blocks."""
        with self._cond:
            results = list(self._results)
            self._results.clear()
        return results

    def wait(self, timeout_s: float) -> list[TransferResult]:
        """``poll``, but block up to ``timeout_s`` for at least one result (tests, benchmarks)."""
        deadline = time.perf_counter() + timeout_s
        with self._cond:
            while not self._results:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            results = list(self._results)
            self._results.clear()
        return results

    def expect_reads(self, active: bool) -> None:
        """Whether peers may read this engine's blocks from now on (the P/D connector's prefill:
        while it holds a lease). A transport that must make progress on the serving side for a
        read to complete (NIXL over UCX without one-sided reads) does so only while it is
        True, and sleeps otherwise; the others need not know."""
        return None

    def poll_served(self) -> list[ServedRead]:
        """Reads of this engine's blocks that peers completed since the last call (a transport
        built with ``track_served=True``)."""
        if not self.track_served:
            raise RuntimeError(f"{self.name} transport: poll_served needs track_served=True")
        with self._cond:
            served = list(self._served)
            self._served.clear()
        return served

    def state(self, transfer_id: str) -> TransferState | None:
        """TRANSFERRING while in flight; the end state if reported but not yet polled; else None."""
        with self._cond:
            if transfer_id in self._in_flight:
                return TransferState.TRANSFERRING
            for result in self._results:
                if result.transfer_id == transfer_id:
                    return result.state
        return None

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def close(self) -> None:
        """Stop every thread, fail reads still in flight, release sockets and registrations."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._close()
        finally:
            with self._cond:
                leftovers = [job for job in self._in_flight.values() if not job.done]
            for job in leftovers:
                self._finish(job, "transport closed")

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses

    @abstractmethod
    def _transport_metadata(self) -> dict[str, Any]:
        """Transport-specific part of ``local_metadata`` (address, agent metadata, ...)."""

    @abstractmethod
    def _add_remote(self, peer: RemotePeer) -> None:
        """Prepare to read from ``peer`` (may defer connecting to the first read)."""

    @abstractmethod
    def _remove_remote(self, engine_id: str) -> None:
        """Drop a peer; fail its reads in flight via ``_finish``."""

    @abstractmethod
    def _start_read(self, job: ReadJob) -> None:
        """Hand ``job`` to the transport's thread. Must not block."""

    @abstractmethod
    def _close(self) -> None:
        """Stop threads and release resources; must return promptly."""

    def _finish(self, job: ReadJob, error: str | None) -> None:
        """Report a read's end (first call wins). Call only once nothing writes its blocks any more."""
        with self._cond:
            if job.done:
                return
            job.done = True
            if self._in_flight.get(job.transfer_id) is job:
                del self._in_flight[job.transfer_id]
            self._results.append(
                TransferResult(
                    transfer_id=job.transfer_id,
                    ok=error is None,
                    error=error,
                    nbytes=job.nbytes if error is None else 0,
                    seconds=time.perf_counter() - job.started,
                    engine_id=job.engine_id,
                )
            )
            self._cond.notify_all()
        if error is not None:
            logger.debug("%s read %s from %s failed: %s", self.name, job.transfer_id, job.engine_id, error)
        self._notify()

    def _report_served(self, transfer_id: str, reader: str) -> None:
        if not self.track_served:
            return
        with self._cond:
            self._served.append(ServedRead(transfer_id, reader))
        self._notify()

    def _notify(self) -> None:
        if self._wakeup is not None:
            try:
                self._wakeup()
            except Exception:  # a broken wake-up hook must not kill a transport thread
                logger.exception("transport wakeup hook failed")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")

    def _check_served_runs(self, runs: Any) -> list[tuple[int, int]]:
        """Validate a peer's ``[[start, count], ...]`` against this cache (server side)."""
        if not isinstance(runs, list):
            raise ValueError("runs must be a list")
        checked = []
        for run in runs:
            if not (isinstance(run, list | tuple) and len(run) == 2 and all(type(x) is int for x in run)):
                raise ValueError(f"bad run {run!r}: expected [start, count]")
            start, count = run
            if count <= 0 or start < 0 or start + count > self.num_blocks:
                raise ValueError(f"run {run!r} outside blocks [0, {self.num_blocks})")
            checked.append((start, count))
        return checked


def _block_id(value: Any, what: str) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # ints, numpy ints, integer 0-d tensors
        except TypeError:
            pass
    raise ValueError(f"{what} must hold ints, got {value!r}")


def _check_cache(kv_cache: Any, spec: Any) -> None:
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.device.type != "cpu":
        raise ValueError(f"kv_cache must live in host memory for these transports, got {kv_cache.device}")
    if not kv_cache.is_contiguous() or kv_cache.dim() < 2 or kv_cache.shape[0] == 0:
        raise ValueError("kv_cache must be a contiguous [num_blocks, ...] tensor with at least one block")
    if spec is not None and (
        tuple(kv_cache.shape[1:]) != tuple(spec.block_shape) or kv_cache.dtype != spec.torch_dtype
    ):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match the KV spec "
            f"[num_blocks, {', '.join(map(str, spec.block_shape))}] {spec.torch_dtype}"
        )
