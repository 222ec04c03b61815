"""Build the connector an engine's ``KVTransferConfig`` asks for."""

from __future__ import annotations

from pdserve.config import KVTransferConfig
from pdserve.connector.base import KVConnectorBase
from pdserve.engine.kv_layout import KVCacheSpec


def create_connector(config: KVTransferConfig, spec: KVCacheSpec, weights: str = "") -> KVConnectorBase:
    """``weights`` says what this engine's weights are held as (``LoadedModel.weights``): told to
    peers in the handshake, so each side's log says what the other runs. KV is the same layout
    whatever the weights, so it is not checked."""
    from pdserve.connector.pd_connector import PDConnector

    return PDConnector(config, spec, weights=weights)
