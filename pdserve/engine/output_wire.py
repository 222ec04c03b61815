"""A core output as the router reads it: the ``EngineGenerateResponse`` fields of one output, and
the status that ends a request whose output is an error.

Written by the front (``Generate``, and a ``Session`` on gRPC) and by the core itself (a framed
session, ``core_sessions``): one mapping, so that both carriers say the same thing.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.engine.outputs import EngineCoreOutput
from pdserve.wire import kv_params_to_proto


def response_fields(output: EngineCoreOutput, timeline: dict[str, float] | None) -> dict[str, Any]:
    """An ``EngineGenerateResponse``'s fields, the unset ones left out: a session's message
    builds each output in place from them (``outputs.add``), half the time of a copy."""
    fields: dict[str, Any] = {
        "request_id": output.request_id,
        "token_ids": output.new_token_ids,
        "num_cached_tokens": output.num_cached_tokens,
        "num_prefix_hit_tokens": output.num_prefix_hit_tokens,
    }
    if output.finish_reason:
        fields["finish_reason"] = output.finish_reason
    if output.kv_transfer_params:
        fields["kv_transfer_params"] = kv_params_to_proto(output.kv_transfer_params)
    if timeline:
        fields["timeline"] = timeline
    return fields


def error_status(reason: str) -> tuple[grpc.StatusCode, str]:
    """The status (and its message) of a request that ended with an ``error`` output."""
    if reason == "kv_load_failed":
        # Not UNAVAILABLE: this engine is fine, the request's remote KV is what was lost.
        return (
            grpc.StatusCode.ABORTED,
            "KV transfer from the prefill engine failed (kv_load_failure_policy=fail)",
        )
    if reason.startswith("internal error"):
        return grpc.StatusCode.INTERNAL, reason
    if reason == "engine core died":
        return grpc.StatusCode.UNAVAILABLE, "engine core died"
    return grpc.StatusCode.INVALID_ARGUMENT, reason
