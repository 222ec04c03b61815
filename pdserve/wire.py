"""Conversions between the gRPC messages (``pdserve.v1``) and pdserve's own types.

Each ``*_from_proto`` validates as it converts and raises ValueError naming the field, which
the servicers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

from pdserve.connector.transfer_params import SCALAR_FIELDS
from pdserve.engine.outputs import SchedulerStats
from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16


# Optional proto fields and the SamplingParams default each takes when unset.
_OPTIONAL_SAMPLING_FIELDS = {
    "max_tokens": DEFAULT_MAX_TOKENS,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
}


def sampling_from_proto(msg: common_pb2.SamplingParams, num_prior_output_tokens: int = 0) -> SamplingParams:
    """An unset field takes its default; a set one is taken as given (0 stays 0 and is refused
    by validation where it is out of range)."""
    values: dict[str, Any] = {
        name: (getattr(msg, name) if msg.HasField(name) else default)
        for name, default in _OPTIONAL_SAMPLING_FIELDS.items()
    }
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
    ):
        values[name] = float(values[name])
    return SamplingParams(
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
        num_prior_output_tokens=num_prior_output_tokens,
        **values,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def kv_params_from_proto(msg: common_pb2.KVTransferParams) -> dict[str, Any] | None:
    if not (msg.do_remote_decode or msg.do_remote_prefill):
        return None
    params: dict[str, Any] = {name: getattr(msg, name) for name in SCALAR_FIELDS}
    params["remote_block_ids"] = list(msg.remote_block_ids)
    return params


def kv_params_to_proto(params: dict[str, Any] | None) -> common_pb2.KVTransferParams | None:
    if not params:
        return None
    fields = {name: params[name] for name in SCALAR_FIELDS if params.get(name) is not None}
    return common_pb2.KVTransferParams(remote_block_ids=list(params.get("remote_block_ids", [])), **fields)


def engine_stats_to_proto(
    stats: SchedulerStats, role: str, address: str, healthy: bool
) -> common_pb2.EngineStats:
    connector = stats.kv_connector  # the connector's own counters: none without a connector
    return common_pb2.EngineStats(
        role=role,
        address=address,
        kv_usage=stats.kv_cache_usage,
        num_running=stats.num_running_reqs,
        num_waiting=stats.num_waiting_reqs,
        num_waiting_for_remote_kvs=stats.num_waiting_for_remote_kvs,
        num_held_blocks=stats.num_held_blocks,
        healthy=healthy,
        num_blocks_pulled=int(connector.get("num_blocks_pulled", 0)),
        num_loads_failed=int(connector.get("num_loads_failed", 0)),
        num_leases_expired=int(connector.get("num_leases_expired", 0)),
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
    )
