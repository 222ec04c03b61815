"""Conversions between the gRPC messages (``pdserve.v1``) and pdserve's own types.

Each ``*_from_proto`` validates as it converts and raises ValueError naming the field, which
the servicers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16

_KV_FIELDS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_instance_id",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "num_tokens",
    "lease_ms",
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        top_k=int(msg.top_k) if msg.HasField("top_k") else -1,
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def kv_params_from_proto(msg: common_pb2.KVTransferParams) -> dict[str, Any] | None:
    if not (msg.do_remote_decode or msg.do_remote_prefill):
        return None
    params: dict[str, Any] = {name: getattr(msg, name) for name in _KV_FIELDS}
    params["remote_block_ids"] = list(msg.remote_block_ids)
    return params


def kv_params_to_proto(params: dict[str, Any] | None) -> common_pb2.KVTransferParams | None:
    if not params:
        return None
    fields = {name: params[name] for name in _KV_FIELDS if params.get(name) is not None}
    return common_pb2.KVTransferParams(remote_block_ids=list(params.get("remote_block_ids", [])), **fields)


def engine_stats_to_proto(stats: dict[str, Any], role: str, address: str, healthy: bool) -> common_pb2.EngineStats:
    connector = stats.get("kv_connector") or {}
    return common_pb2.EngineStats(
        role=role,
        address=address,
        kv_usage=float(stats.get("kv_cache_usage", 0.0)),
        num_running=int(stats.get("num_running_reqs", 0)),
        num_waiting=int(stats.get("num_waiting_reqs", 0)),
        num_waiting_for_remote_kvs=int(stats.get("num_waiting_for_remote_kvs", 0)),
        num_held_blocks=int(stats.get("num_held_blocks", 0)),
        healthy=healthy,
        num_blocks_pulled=int(connector.get("num_blocks_pulled", 0)),
        num_loads_failed=int(connector.get("num_loads_failed", 0)),
        num_leases_expired=int(connector.get("num_leases_expired", 0)),
        prefix_cache_queries=int(stats.get("prefix_cache_queries", 0)),
        prefix_cache_hits=int(stats.get("prefix_cache_hits", 0)),
        num_preemptions=int(stats.get("num_preemptions", 0)),
    )
