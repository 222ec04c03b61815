"""The KV connector interface (vLLM v1's ``KVConnectorBase_V1``), one object, two sides.

Scheduler side (runs inside ``schedule()`` / ``update_from_output``): decides how many tokens
come from a remote engine, learns which blocks were allocated for them, packs per-step work
into metadata, and says whether a finished request's blocks must outlive it.

Worker side (runs around the forward pass): registers the KV cache tensor, starts loads,
saves, and reports which transfers finished. ``get_finished`` is polled every step; it and
``start_load_kv`` must never block on a transfer.

Subclasses implement every abstract method; the scheduler relies on no state set here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.engine.outputs import SchedulerOutput
    from pdserve.engine.request import Request


@dataclass
class KVConnectorMetadata:
    """Opaque per-step work from the scheduler side to the worker side of a connector."""


class KVConnectorBase(ABC):
    # ---------------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (the local prefix-cache hit) that a remote engine
        will supply, and whether they arrive asynchronously (the request then waits in
        ``WAITING_FOR_REMOTE_KVS``)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``; the last ``num_external_tokens`` worth are to be
        filled from the remote engine."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Pack this step's loads/saves for the worker side and reset per-step state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished. Returns ``(delay_free, kv_transfer_params)``: with ``delay_free``
        the scheduler keeps the blocks until the id shows up in ``finished_sending`` (or
        ``finished_recving`` for a load still in flight)."""

    def request_released(self, request_id: str) -> None:
        """The scheduler freed a held request's blocks early (abort): forget its lease."""
        return None

    def shutdown(self) -> None:
        """Release sockets, threads and registered memory."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters for the engine's Stats (blocks pulled, loads failed, leases expired...)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What the engine's front reports about this connector (addresses, transport)."""
        return {}

    def take_request_timeline(self, request_id: str) -> dict[str, float]:
        """``{event: unix time}`` of a finished load's transfer events (pull start and end, lease
        released), for the request's timeline; called once, when the load is reported done."""
        return {}

    # ---------------------------------------------------------------- worker side

    @property
    def needs_shared_kv_cache(self) -> bool:
        """Whether the engine must allocate its cache in shared memory before
        ``register_kv_caches`` (a peer on this host maps it: the ``shm`` transport)."""
        return False

    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The engine's KV cache tensor (``pdserve.engine.kv_layout`` layout)."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's loads; returns at once."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (a no-op for whole-block async loads)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, metadata: KVConnectorMetadata) -> None:
        """Start saving one layer's KV (a no-op when the remote side pulls)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(done_sending, done_recving)`` request ids since the last call."""

    def get_invalid_block_ids(self) -> set[int]:
        """Blocks whose load failed since the last call (their requests are in done_recving)."""
        return set()
