"""The wire format between an engine's front process and its core process: msgpack maps.

No pickle: every message is a map of plain types, and decoding rebuilds typed objects, so a
malformed message fails with a ValueError instead of executing anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from pdserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pdserve.engine.request import SamplingParams

# Message types, front -> core.
ADD = "add"
ABORT = "abort"
STATS = "stats"
RESET_PREFIX_CACHE = "reset_prefix_cache"
SHUTDOWN = "shutdown"
# Core -> front.
OUTPUTS = "outputs"
READY = "ready"
STATS_REPLY = "stats_reply"


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"malformed message: {exc}") from None
    if not isinstance(message, dict) or "type" not in message:
        raise ValueError("malformed message: expected a map with a 'type'")
    return message


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def sampling_from_dict(data: dict[str, Any]) -> SamplingParams:
    allowed = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"sampling_params: unknown fields {sorted(unknown)}")
    return SamplingParams(**data)


def output_to_dict(output: EngineCoreOutput) -> dict[str, Any]:
    return dataclasses.asdict(output)


def output_from_dict(data: dict[str, Any]) -> EngineCoreOutput:
    return EngineCoreOutput(**data)


def stats_to_dict(stats: SchedulerStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)
