"""KVTransferParams is the one place kv_transfer_params keys are spelled and checked."""

from __future__ import annotations

import pytest

from pdserve.connector.transfer_params import SCALAR_FIELDS, KVTransferParams
from pdserve.connector.transfer_worker import RemoteRef
from pdserve.wire import kv_params_from_proto, kv_params_to_proto

PARAMS = KVTransferParams(
    do_remote_prefill=True,
    remote_engine_id="prefill-0",
    remote_instance_id="abc",
    remote_host="10.0.0.7",
    remote_port=7001,
    remote_request_id="req-1",
    remote_block_ids=[4, 5, 9],
    num_tokens=40,
    lease_ms=30000,
)


def test_round_trips_through_a_dict_and_the_proto():
    assert KVTransferParams.from_dict(PARAMS.to_dict()) == PARAMS
    assert kv_params_from_proto(kv_params_to_proto(PARAMS.to_dict())) == PARAMS.to_dict()
    assert set(SCALAR_FIELDS) | {"remote_block_ids"} == set(PARAMS.to_dict())


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"remote_prot": 1}, "unknown keys"),
        ({"remote_port": "7001"}, "remote_port must be int"),
        ({"remote_port": True}, "remote_port must be int"),
        ({"do_remote_prefill": 1}, "do_remote_prefill must be bool"),
        ({"remote_block_ids": [1, "2"]}, "list of block ids"),
    ],
)
def test_a_bad_dict_is_a_clear_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        KVTransferParams.from_dict({**PARAMS.to_dict(), **bad})


def test_remote_ref_needs_a_full_address():
    assert RemoteRef.from_params(PARAMS.to_dict()) == RemoteRef("prefill-0", "abc", "10.0.0.7", 7001)
    with pytest.raises(ValueError, match="remote address"):
        RemoteRef.from_params({"do_remote_prefill": True, "remote_engine_id": "prefill-0"})
