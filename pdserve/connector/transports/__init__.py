"""KV block transports behind one interface (``base.KVTransport``), chosen by name.

``tcp`` is always available. ``shm`` needs Linux (memfd, pidfd, /proc) and both engines on one
host; it is never picked by ``auto``, which cannot know where the peer runs. ``ucx`` needs
``ucxx`` (ucxx-cu12) to import; ``nixl`` needs ``nixl`` to import *and* to bring up an agent with its UCX backend (the wheel imports fine on a
machine where its plugins cannot load). ``auto`` picks the first available of
``AUTO_PREFERENCE``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pdserve.connector.transports.base import (
    BlockRun,
    KVTransport,
    ServedRead,
    TransferResult,
    TransferState,
    TransportRole,
    coalesce_runs,
)

logger = logging.getLogger(__name__)

ALL_TRANSPORTS = ("tcp", "ucx", "nixl", "shm")
# One-sided NIXL READs need nothing from prefill's threads; UCX tag messages need prefill's
# worker thread to answer; TCP goes through the kernel's loopback stack twice.
AUTO_PREFERENCE = ("nixl", "ucx", "tcp")

__all__ = [
    "ALL_TRANSPORTS",
    "BlockRun",
    "KVTransport",
    "ServedRead",
    "TransferResult",
    "TransferState",
    "TransportRole",
    "available_transports",
    "coalesce_runs",
    "create_transport",
    "transport_class",
]


@functools.cache
def _probe(name: str) -> str | None:
    """None if transport ``name`` can run in this process, else why not (probed once)."""
    try:
        if name == "tcp":
            return None
        if name == "ucx":
            from pdserve.connector.transports.ucx import probe_ucx

            return probe_ucx()
        if name == "nixl":
            from pdserve.connector.transports.nixl import probe_nixl

            return probe_nixl()
        if name == "shm":
            from pdserve.connector.transports.shm import probe_shm

            return probe_shm()
    except Exception as exc:  # an optional library failing in any way means "not available"
        return f"{type(exc).__name__}: {exc}"
    return f"unknown transport {name!r}"


def available_transports() -> list[str]:
    """Transports usable here, in ``ALL_TRANSPORTS`` order."""
    available = []
    for name in ALL_TRANSPORTS:
        reason = _probe(name)
        if reason is None:
            available.append(name)
        else:
            logger.debug("transport %s unavailable: %s", name, reason)
    return available


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot be used here (None if it can)."""
    return _probe(name)


def transport_class(name: str) -> type[KVTransport]:
    """The class for ``name`` (``auto`` resolved); ValueError if unknown or unavailable."""
    if name == "auto":
        name = next(n for n in AUTO_PREFERENCE if _probe(n) is None)
    if name not in ALL_TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: expected one of {('auto', *ALL_TRANSPORTS)}")
    reason = _probe(name)
    if reason is not None:
        raise ValueError(f"transport {name!r} is not available here: {reason}")
    if name == "tcp":
        from pdserve.connector.transports.tcp import TcpTransport

        return TcpTransport
    if name == "ucx":
        from pdserve.connector.transports.ucx import UcxTransport

        return UcxTransport
    if name == "shm":
        from pdserve.connector.transports.shm import ShmTransport

        return ShmTransport
    from pdserve.connector.transports.nixl import NixlTransport

    return NixlTransport


def create_transport(name: str, kv_cache: Any, **kwargs: Any) -> KVTransport:
    """Build transport ``name`` (or ``auto``) over ``kv_cache``.

    Common keyword arguments (see ``KVTransport``): ``role`` ("producer" | "consumer" | "both",
    default "both"), ``engine_id``, ``transfer_timeout_s``, ``wakeup``, ``spec`` (a
    ``KVCacheSpec`` the cache is checked against). ``host`` is the bind address of the tcp
    listener (ignored by ucx and nixl, which reach peers through their worker/agent metadata);
    anything else goes to the transport's own constructor (e.g. ``fault=TcpFault(...)``).
    """
    cls = transport_class(name)
    if cls.name != "tcp":
        kwargs.pop("host", None)
        kwargs.pop("advertise_host", None)
        kwargs.pop("token", None)
    return cls(kv_cache, **kwargs)
