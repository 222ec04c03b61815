"""The P/D connector: prefill holds finished prompts' blocks under a lease, decode pulls them.

Producer role (prefill): ``request_finished`` keeps a length-capped (first-token-done)
request's blocks under a lease and returns the ``kv_transfer_params`` decode needs. The side
channel answers handshakes and takes releases and renewals; released or expired leases come
back to the scheduler as ``finished_sending``.

Consumer role (decode): ``get_num_new_matched_tokens`` counts the prompt tokens a remote
engine holds beyond the local prefix-cache hit; once blocks are allocated the load is handed to
the transfer thread (``transfer_worker.py``), so the engine loop never waits on a transfer.
Finished loads come back as ``finished_recving``; failed ones also as invalid block ids, which
the scheduler recomputes or fails by ``kv_load_failure_policy``.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdserve.config import KVTransferConfig
from pdserve.connector.base import KVConnectorBase, KVConnectorMetadata
from pdserve.connector.leases import LeaseTable
from pdserve.connector.side_channel import SideChannelServer
from pdserve.connector.transfer_params import PD_CONNECTOR_VERSION, KVTransferParams
from pdserve.connector.transfer_worker import LoadJob, RemoteRef, TransferWorker
from pdserve.engine.kv_layout import KVCacheSpec
from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.connector.transports.base import KVTransport

logger = logging.getLogger(__name__)


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    # Full local prefix hits: nothing to pull, but prefill must still be told to free.
    releases: list[tuple[RemoteRef, str]] = field(default_factory=list)


class PDConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, weights: str = "") -> None:
        self.config = config
        self.spec = spec
        self.weights = weights  # what the weights are held as, told to peers in the handshake
        self.block_size = spec.block_size
        self.is_producer = config.role in ("producer", "both")
        self.is_consumer = config.role in ("consumer", "both")
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        # Changes on every start, so a peer can tell a restarted engine from the one it knew.
        self.instance_id = uuid.uuid4().hex
        self.leases = LeaseTable(config.lease_ms / 1000.0)
        self.transport: KVTransport | None = None
        self.side_channel: SideChannelServer | None = None
        self.worker: TransferWorker | None = None
        # Scheduler-side state (engine thread only).
        self._local_hit_tokens: dict[str, int] = {}  # {req_id: local prefix-cache hit at match time}
        self._loading: set[str] = set()  # loads handed to the worker, not yet reported done
        self._step_loads: list[LoadJob] = []
        self._step_releases: list[tuple[RemoteRef, str]] = []
        self._invalid_block_ids: set[int] = set()

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not self.is_consumer or not params.get("do_remote_prefill"):
            return 0, False
        # The last token is computed here (its logits give the next token), never loaded.
        remote_tokens = min(int(params.get("num_tokens", 0)), request.num_tokens - 1)
        self._local_hit_tokens[request.request_id] = num_computed_tokens
        num_external = remote_tokens - num_computed_tokens
        if num_external <= 0:
            return 0, False
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if not self.is_consumer or not params.get("do_remote_prefill"):
            return
        # Load at most once: a request preempted later recomputes instead of pulling again.
        params["do_remote_prefill"] = False
        remote = RemoteRef.from_params(params)
        remote_req_id = str(params.get("remote_request_id", request.request_id))
        num_local = self._local_hit_tokens.pop(request.request_id, 0)
        if num_external_tokens == 0:
            self._step_releases.append((remote, remote_req_id))
            return
        first_block = num_local // self.block_size
        end_block = -(-(num_local + num_external_tokens) // self.block_size)
        remote_block_ids = list(params.get("remote_block_ids", []))[first_block:end_block]
        local_block_ids = block_ids[first_block:end_block]
        job = LoadJob(
            req_id=request.request_id,
            remote=remote,
            remote_req_id=remote_req_id,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
        )
        if len(remote_block_ids) != len(local_block_ids):
            job.error = (
                f"remote_block_ids lists {len(params.get('remote_block_ids', []))} blocks, "
                f"need {end_block} for {num_local + num_external_tokens} tokens"
            )
        self._loading.add(request.request_id)
        self._step_loads.append(job)
        logger.debug(
            "%s: pull %d blocks from %s (local hit %d tokens)",
            request.request_id,
            len(local_block_ids),
            remote.engine_id,
            num_local,
        )

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(loads=self._step_loads, releases=self._step_releases)
        self._step_loads, self._step_releases = [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._local_hit_tokens.pop(req_id, None)
        if req_id in self._loading:
            # A pull is still writing into these blocks: keep them until it has ended.
            return True, None
        params = request.kv_transfer_params or {}
        if not (
            self.is_producer
            and params.get("do_remote_decode")
            and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        ):
            return False, None
        num_tokens = request.num_prompt_tokens  # the sampled first token has no KV yet
        held = block_ids[: -(-num_tokens // self.block_size)]
        self.leases.add(req_id, held)
        self._expect_reads()
        request.mark("lease_registered")
        assert self.side_channel is not None, "register_kv_caches() was not called"
        return True, KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_instance_id=self.instance_id,
            remote_host=self.config.reachable_host,
            remote_port=self.side_channel.port,
            remote_request_id=req_id,
            remote_block_ids=list(held),
            num_tokens=num_tokens,
            lease_ms=int(self.config.lease_ms),
        ).to_dict()

    def request_released(self, request_id: str) -> None:
        self.leases.drop(request_id)
        self._expect_reads()

    def _expect_reads(self) -> None:
        """Tell the transport whether a decode engine may read now: while a lease is held."""
        if self.transport is not None:
            self.transport.expect_reads(len(self.leases) > 0)

    # ================================================================ worker side

    @property
    def needs_shared_kv_cache(self) -> bool:
        if not self.is_producer:
            return False
        from pdserve.connector.transports import transport_class

        return transport_class(self.config.transport).needs_shared_cache

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        from pdserve.connector.transports import create_transport

        self.transport = create_transport(
            self.config.transport,
            kv_cache,
            role=self.config.role,
            engine_id=f"{self.engine_id}/{self.instance_id}",
            spec=self.spec,
            host=self.config.host,
            advertise_host=self.config.advertise_host,
            token=self.config.cluster_token,
            transfer_timeout_s=self.config.transfer_timeout_s,
            # A finished read wakes the transfer thread at once (it would otherwise notice it
            # on its next poll, up to a poll interval later, on every handover).
            wakeup=self._wake_worker,
            **_transport_options(self.config),
        )
        if self.is_producer:
            self.side_channel = SideChannelServer(
                self.config.host,
                self.config.side_channel_port,
                {"handshake": self._on_handshake, "release": self._on_release, "renew": self._on_renew},
                token=self.config.cluster_token,
            )
            logger.info(
                "KV producer %s: side channel %s:%d, transport %s",
                self.engine_id,
                self.config.host,
                self.side_channel.port,
                self.transport.name,
            )
        if self.is_consumer:
            self.worker = TransferWorker(
                transport=self.transport,
                fingerprint=self.spec.fingerprint(),
                engine_id=self.engine_id,
                weights=self.weights,
                token=self.config.cluster_token,
                transfer_timeout_s=self.config.transfer_timeout_s,
                lease_renew_s=self.config.lease_ms / 3000.0,
            )

    def _wake_worker(self) -> None:
        if self.worker is not None:
            self.worker.wake()

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, PDConnectorMetadata)
        if self.worker is None:
            return
        for job in metadata.loads:
            self.worker.submit_load(job)
        for remote, remote_req_id in metadata.releases:
            self.worker.submit_release(remote, remote_req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole blocks are loaded before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, metadata: KVConnectorMetadata) -> None:
        return None  # decode pulls; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done_sending = self.leases.take_done() if self.is_producer else set()
        if done_sending:
            self._expect_reads()
        done_recving: set[str] = set()
        if self.worker is not None:
            done_recving, invalid = self.worker.take_finished()
            self._invalid_block_ids |= invalid
            self._loading -= done_recving
        return done_sending or None, done_recving or None

    def take_request_timeline(self, request_id: str) -> dict[str, float]:
        return self.worker.take_timeline(request_id) if self.worker is not None else {}

    def get_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # ================================================================ side channel (its thread)

    def _on_handshake(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("version") != PD_CONNECTOR_VERSION:
            raise ValueError(
                f"P/D connector version mismatch: this engine speaks {PD_CONNECTOR_VERSION}, "
                f"the peer {message.get('version', 'an older one (no version)')}"
            )
        mine = self.spec.fingerprint()
        theirs = message.get("fingerprint")
        if theirs != mine:
            raise ValueError(f"KV layout mismatch: this engine has {mine}, the peer has {theirs}")
        assert self.transport is not None
        logger.info(
            "handshake from %s (weights %s); this engine's weights: %s",
            message.get("engine_id", "?"),
            message.get("weights") or "not said",
            self.weights or "not said",
        )
        return {
            "ok": True,
            "weights": self.weights,
            "version": PD_CONNECTOR_VERSION,
            "engine_id": self.engine_id,
            "instance_id": self.instance_id,
            "fingerprint": mine,
            "transport": self.transport.name,
            "transport_metadata": self.transport.local_metadata(),
        }

    def _on_release(self, message: dict[str, Any]) -> dict[str, Any]:
        released = [rid for rid in _id_list(message) if self.leases.release(rid)]
        logger.debug("released %s", released)
        return {"ok": True, "released": len(released)}

    def _on_renew(self, message: dict[str, Any]) -> dict[str, Any]:
        renewed = [rid for rid in _id_list(message) if self.leases.renew(rid)]
        return {"ok": True, "renewed": len(renewed)}

    # ================================================================ misc

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_held_leases": len(self.leases),
            "num_leases_released": self.leases.num_released,
            "num_leases_expired": self.leases.num_expired,
        }
        if self.worker is not None:
            out.update(self.worker.counters())
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "role": self.config.role,
            "transport": self.transport.name if self.transport else None,
            "side_channel": f"{self.config.reachable_host}:{self.side_channel.port}"
            if self.side_channel
            else None,
        }

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.side_channel is not None:
            self.side_channel.close()
        if self.transport is not None:
            self.transport.close()


def _transport_options(config: KVTransferConfig) -> dict[str, Any]:
    """Transport constructor options from the JSON-able config (``extra["transport_options"]``)."""
    options = dict(config.extra.get("transport_options", {}))
    if isinstance(options.get("fault"), dict):  # fault injection for reliability tests (tcp only)
        from pdserve.connector.transports.tcp import TcpFault

        options["fault"] = TcpFault(**options["fault"])
    return options


def _id_list(message: dict[str, Any]) -> list[str]:
    ids = message.get("request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError("request_ids must be a list of strings")
    return ids
