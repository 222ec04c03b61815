"""Build the connector an engine's ``KVTransferConfig`` asks for."""

from __future__ import annotations

from pdserve.config import KVTransferConfig
from pdserve.connector.base import KVConnectorBase
from pdserve.engine.kv_layout import KVCacheSpec


def create_connector(config: KVTransferConfig, spec: KVCacheSpec) -> KVConnectorBase:
    from pdserve.connector.pd_connector import PDConnector

    return PDConnector(config, spec)
