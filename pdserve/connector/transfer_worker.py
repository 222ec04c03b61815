"""The decode side's transfer thread: handshakes, pulls, lease renewals, releases.

The engine loop only enqueues jobs and collects results, so it never waits on the network.
Each load moves through one small state machine (SGLang's shape): BOOTSTRAPPING (handshake with
the prefill engine, cached per peer), TRANSFERRING (the transport's read is in flight), then
SUCCESS or FAILED. Either way prefill is told to release its blocks; a failure also reports the
local block ids as invalid so the scheduler recomputes or fails the request.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.connector.side_channel import SideChannelClient, SideChannelError
from pdserve.connector.transfer_params import PD_CONNECTOR_VERSION, KVTransferParams

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
# With reads in flight the thread also wakes this often on its own, for deadlines and lease
# renewals; completions wake it at once through the transport's wakeup hook (``wake``). With
# none it sleeps until a job or ``close`` comes: waking every 50 ms cost an idle decode engine
# ~4.5 ms of CPU a second on a 2-core KVM guest.
IN_FLIGHT_POLL_S = 0.005
# Past its deadline the transport must report a transfer failed; if it has not after this much
# more, the worker reports it failed itself rather than let the request hang.
DEADLINE_GRACE_S = 2.0


class PullState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


@dataclass(frozen=True)
class RemoteRef:
    """Which prefill engine holds the blocks, from the request's ``kv_transfer_params``."""

    engine_id: str
    instance_id: str
    host: str
    port: int

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteRef:
        typed = KVTransferParams.from_dict(params)
        if not typed.remote_engine_id or not typed.remote_host or not 0 < typed.remote_port < 65536:
            raise ValueError(
                "kv_transfer_params: missing or bad remote address "
                f"(engine {typed.remote_engine_id!r}, host {typed.remote_host!r}, port {typed.remote_port})"
            )
        return cls(typed.remote_engine_id, typed.remote_instance_id, typed.remote_host, typed.remote_port)

    @property
    def transport_key(self) -> str:
        # A restarted peer is a new transport endpoint even on the same address.
        return f"{self.engine_id}/{self.instance_id}"


@dataclass
class LoadJob:
    req_id: str
    remote: RemoteRef
    remote_req_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    error: str | None = None  # set when the job is invalid before it starts
    state: PullState = PullState.BOOTSTRAPPING
    started_at: float = 0.0
    deadline: float = 0.0
    next_renew_at: float = 0.0
    # {event: unix time}: pull_start, pull_end, released (reported with the request's timeline).
    timeline: dict[str, float] = field(default_factory=dict)


@dataclass
class _Peer:
    client: SideChannelClient
    instance_id: str
    handshaken: bool = False


@dataclass
class _Release:
    remote: RemoteRef
    remote_req_id: str


_WAKE = object()  # queued by ``wake``: look at the transport now


class TransferWorker:
    def __init__(
        self,
        transport: Any,
        fingerprint: dict[str, Any],
        engine_id: str,
        token: str | None,
        transfer_timeout_s: float,
        lease_renew_s: float,
        weights: str = "",
    ) -> None:
        self.transport = transport
        self.fingerprint = fingerprint
        self.engine_id = engine_id
        self.weights = weights  # what this engine's weights are held as (told to prefill peers)
        self.token = token
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_renew_s = lease_renew_s
        self._jobs: queue.Queue[LoadJob | _Release | object] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._timelines: dict[str, dict[str, float]] = {}  # {req_id: events}, until taken
        self._invalid: set[int] = set()
        self._last_error = ""
        self._counters = {
            "num_loads_ok": 0,
            "num_loads_failed": 0,
            "num_blocks_pulled": 0,
            "transfer_seconds": 0.0,
        }
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._in_flight: dict[str, LoadJob] = {}  # {req_id: job}, owned by the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread

    def submit_load(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def submit_release(self, remote: RemoteRef, remote_req_id: str) -> None:
        self._jobs.put(_Release(remote, remote_req_id))

    def wake(self) -> None:
        """A read ended (the transport's thread calls this): collect it now."""
        self._jobs.put(_WAKE)

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Loads that ended since the last call, and the local blocks of the failed ones."""
        with self._lock:
            done, self._done = self._done, set()
            invalid, self._invalid = self._invalid, set()
        return done, invalid

    def take_timeline(self, req_id: str) -> dict[str, float]:
        """The transfer events of a load reported done by ``take_finished`` (once)."""
        with self._lock:
            return self._timelines.pop(req_id, {})

    def counters(self) -> dict[str, Any]:
        """Totals over every load this worker finished, and the last failure (for Stats)."""
        with self._lock:
            return {**self._counters, "last_load_error": self._last_error}

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(_WAKE)  # an idle thread sleeps on the queue
        self._thread.join(timeout=5)
        for peer in self._peers.values():
            peer.client.close()

    # ------------------------------------------------------------------ transfer thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take_jobs(block_s=IN_FLIGHT_POLL_S if self._in_flight else None)
                self._collect_results()
                self._enforce_deadlines()
                self._renew_leases()
                for peer in self._peers.values():
                    peer.client.drain()
            except Exception:  # the thread must survive anything one job does
                logger.exception("kv transfer thread: unexpected error")

    def _take_jobs(self, block_s: float | None) -> None:
        try:
            item = self._jobs.get(timeout=block_s)
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Release):
                self._notify(item.remote, "release", [item.remote_req_id])
            elif isinstance(item, LoadJob):
                self._start(item)
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _start(self, job: LoadJob) -> None:
        job.started_at = time.monotonic()
        if job.error is not None:
            self._finish(job, ok=False, error=job.error)
            return
        try:
            self._ensure_handshake(job.remote)
            job.state = PullState.TRANSFERRING
            job.deadline = time.monotonic() + self.transfer_timeout_s
            job.next_renew_at = time.monotonic() + self.lease_renew_s
            self._in_flight[job.req_id] = job
            job.timeline["pull_start"] = time.time()
            self.transport.start_read(
                job.req_id, job.remote.transport_key, job.remote_block_ids, job.local_block_ids
            )
        except Exception as exc:  # handshake refused, peer down, transport error
            self._in_flight.pop(job.req_id, None)
            self._forget_peer(job.remote)
            self._finish(job, ok=False, error=str(exc))

    def _ensure_handshake(self, remote: RemoteRef) -> None:
        peer = self._peer(remote)
        if peer.handshaken and peer.instance_id == remote.instance_id:
            return
        reply = peer.client.request(
            {
                "type": "handshake",
                "version": PD_CONNECTOR_VERSION,
                "engine_id": self.engine_id,
                "fingerprint": self.fingerprint,
                "weights": self.weights,
            },
            timeout_s=HANDSHAKE_TIMEOUT_S,
        )
        if reply.get("version") != PD_CONNECTOR_VERSION:
            raise SideChannelError(
                f"P/D connector version mismatch with {remote.engine_id}: ours {PD_CONNECTOR_VERSION}, "
                f"theirs {reply.get('version')}"
            )
        if reply.get("fingerprint") != self.fingerprint:
            raise SideChannelError(
                f"KV layout mismatch with {remote.engine_id}: ours {self.fingerprint}, "
                f"theirs {reply.get('fingerprint')}"
            )
        if reply.get("transport") != self.transport.name:
            raise SideChannelError(
                f"transport mismatch with {remote.engine_id}: ours {self.transport.name!r}, "
                f"theirs {reply.get('transport')!r}"
            )
        if remote.instance_id and reply.get("instance_id") != remote.instance_id:
            raise SideChannelError(
                f"{remote.engine_id} restarted since it prefilled this request: its blocks are gone"
            )
        self.transport.add_remote(remote.transport_key, reply["transport_metadata"])
        logger.info(
            "handshake with %s: its weights %s, ours %s",
            remote.engine_id,
            reply.get("weights") or "not said",
            self.weights or "not said",
        )
        peer.instance_id = str(reply.get("instance_id", ""))
        peer.handshaken = True
        logger.info("handshake with %s at %s:%d done", remote.engine_id, remote.host, remote.port)

    def _collect_results(self) -> None:
        for result in self.transport.poll():
            job = self._in_flight.pop(result.transfer_id, None)
            if job is None:
                continue
            if not result.ok:
                self._forget_peer(job.remote)
            self._finish(job, ok=result.ok, error=result.error)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for req_id, job in list(self._in_flight.items()):
            if now > job.deadline + DEADLINE_GRACE_S:
                logger.error("%s: transport did not report within its deadline", req_id)
                del self._in_flight[req_id]
                self._forget_peer(job.remote)
                self._finish(job, ok=False, error="transfer timed out")

    def _renew_leases(self) -> None:
        now = time.monotonic()
        for job in self._in_flight.values():
            if now >= job.next_renew_at:
                job.next_renew_at = now + self.lease_renew_s
                self._notify(job.remote, "renew", [job.remote_req_id])

    def _finish(self, job: LoadJob, ok: bool, error: str | None = None) -> None:
        job.timeline["pull_end"] = time.time()
        if ok:
            # Read, then validate: the data is good only if prefill still held the blocks when
            # the read ended (an abort or an expired lease frees them for reuse meanwhile).
            # The release that ends the lease answers exactly that.
            ok, error = self._release_and_confirm(job)
        else:
            # Failed: prefill may free at once; we recompute (or fail) without its blocks.
            self._notify(job.remote, "release", [job.remote_req_id])
        job.state = PullState.SUCCESS if ok else PullState.FAILED
        seconds = time.monotonic() - job.started_at
        if ok:
            logger.debug(
                "%s: pulled %d blocks in %.2f ms", job.req_id, len(job.local_block_ids), seconds * 1e3
            )
        else:
            logger.warning("%s: KV pull from %s failed: %s", job.req_id, job.remote.engine_id, error)
        job.timeline["released"] = time.time()
        with self._lock:
            self._done.add(job.req_id)
            self._timelines[job.req_id] = job.timeline
            if ok:
                self._counters["num_loads_ok"] += 1
                self._counters["num_blocks_pulled"] += len(job.local_block_ids)
                self._counters["transfer_seconds"] += seconds
            else:
                self._counters["num_loads_failed"] += 1
                self._last_error = error or "unknown error"
                self._invalid.update(job.local_block_ids)

    def _release_and_confirm(self, job: LoadJob) -> tuple[bool, str | None]:
        try:
            reply = self._peer(job.remote).client.request(
                {"type": "release", "request_ids": [job.remote_req_id]}, timeout_s=HANDSHAKE_TIMEOUT_S
            )
        except SideChannelError as exc:
            return False, f"could not confirm the lease after the read: {exc}"
        if reply.get("released") != 1:
            return (
                False,
                "prefill no longer held the blocks (lease expired or request aborted) when the read ended",
            )
        return True, None

    def _peer(self, remote: RemoteRef) -> _Peer:
        key = (remote.host, remote.port)
        peer = self._peers.get(key)
        if peer is None:
            peer = _Peer(SideChannelClient(remote.host, remote.port, self.token), remote.instance_id)
            self._peers[key] = peer
        return peer

    def _notify(self, remote: RemoteRef, kind: str, request_ids: list[str]) -> None:
        self._peer(remote).client.notify({"type": kind, "request_ids": request_ids})

    def _forget_peer(self, remote: RemoteRef) -> None:
        peer = self._peers.get((remote.host, remote.port))
        if peer is not None:
            peer.handshaken = False  # redo the handshake next time (it may have restarted)
