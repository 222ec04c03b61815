"""``KVTransferParams``: what a prefill engine hands a decode engine, through the router.

Prefill's connector builds it when a ``do_remote_decode`` request finishes (its blocks held
under a lease); the router carries it in ``EngineGenerateResponse.kv_transfer_params`` /
``EngineGenerateRequest.kv_transfer_params`` (``proto/pdserve/v1/common.proto``); decode's
connector reads where to pull from. Requests carry it as a plain dict
(``Request.kv_transfer_params``, as in vLLM); this class is the one place its keys are spelled,
and ``from_dict`` is the one place a dict is checked.

``PD_CONNECTOR_VERSION`` is the version of everything two engines must agree on: these
parameters, the side-channel messages (handshake, release, renew) and their meaning. Both ends
send it in the handshake; a decode engine refuses to pull from a prefill engine of another
version (a clear error, the request recomputed or failed by ``kv_load_failure_policy``), rather
than misread its blocks. Bump it on any incompatible change and say what changed:

- 1: leases with release/renew, pulls over nixl, ucx or tcp.
- 2: the handshake carries the version (a version-1 peer sends none and is refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PD_CONNECTOR_VERSION = 2


@dataclass
class KVTransferParams:
    do_remote_decode: bool = False  # to prefill: hold the blocks for a remote decode
    do_remote_prefill: bool = False  # to decode: pull the prompt's blocks from the engine below
    remote_engine_id: str = ""
    remote_instance_id: str = ""  # changes on every start: a restarted engine's blocks are gone
    remote_host: str = ""
    remote_port: int = 0  # the prefill engine's side channel
    remote_request_id: str = ""
    remote_block_ids: list[int] = field(default_factory=list)  # in prompt order
    num_tokens: int = 0  # prompt tokens whose KV the blocks hold
    lease_ms: int = 0  # how long prefill holds them without a renewal

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> KVTransferParams:
        """Missing keys take their defaults; an unknown key or a wrong type is a ValueError."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown keys {unknown}")
        values: dict[str, Any] = {}
        for name, value in params.items():
            expected = {"bool": bool, "str": str, "int": int}.get(str(known[name].type))
            if expected is not None:
                if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                    raise ValueError(f"kv_transfer_params: {name} must be {expected.__name__}, got {value!r}")
            elif not isinstance(value, list | tuple) or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in value
            ):
                raise ValueError(f"kv_transfer_params: {name} must be a list of block ids, got {value!r}")
            values[name] = list(value) if expected is None else value
        return cls(**values)


# The scalar fields, for the proto mapping (pdserve/wire.py); remote_block_ids is repeated.
SCALAR_FIELDS = tuple(f.name for f in dataclasses.fields(KVTransferParams) if f.name != "remote_block_ids")
