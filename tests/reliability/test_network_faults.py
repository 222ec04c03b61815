"""Network faults between engines, through the router: a stalled transfer, a peer with another
model, a peer with the wrong cluster token, a reader with no token at all.

Each request a fault hits still ends, within a bound: decode recomputes the prompt itself
(``kv_load_failure_policy=recompute``, the default) or, with ``fail``, the client gets
UNAVAILABLE with a message. The refusal shows in decode's stats (``num_loads_failed``) and its
log, and no KV block stays referenced or held anywhere.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

import grpc
import msgpack
import pytest

from pdserve.client import Client
from pdserve.connector.side_channel import SideChannelClient
from pdserve.connector.transfer_params import PD_CONNECTOR_VERSION
from pdserve.engine.model.tiny import write_tiny_model
from pdserve.engine.request import SamplingParams
from tests.helpers.reliability import (
    HOST,
    TRANSFER_TIMEOUT_S,
    Proc,
    engine_stats,
    fresh_prompt,
    router_health,
    settle,
    wait_idle,
)

MAX_TOKENS = 8
STUCK_TRANSFER = {"action": "stall", "after_bytes": 0}  # stalls until the reader gives up
BOUND_S = 20.0  # a faulty transfer must end well within this


@dataclass
class Env:
    decode: Proc
    fail_decode: Proc  # kv_load_failure_policy=fail
    stuck: Proc  # prefill whose reads never finish
    other_model: Proc  # prefill with a 3-layer model (the decode engines have 2 layers)
    wrong_token: Proc  # prefill with another cluster token
    clients: dict[str, Client]  # {prefill name: router in front of it and decode}

    @property
    def engines(self) -> list[Proc]:
        return [self.decode, self.fail_decode, self.stuck, self.other_model, self.wrong_token]


@pytest.fixture(scope="module")
def env(cluster, shared, tmp_path_factory):
    other_dir = write_tiny_model(str(tmp_path_factory.mktemp("tiny-3-layers")), seed=0, num_layers=3)
    stuck = cluster.engine("net-prefill-stuck", "prefill", tcp_fault=STUCK_TRANSFER)
    other_model = cluster.engine("net-prefill-other-model", "prefill", model=other_dir)
    wrong_token = cluster.engine("net-prefill-wrong-token", "prefill", token="not-the-cluster-token")
    fail_decode = cluster.engine("net-decode-fail", "decode", args=["--kv-load-failure-policy", "fail"])
    cluster.wait_serving()
    routers = {
        "stuck": cluster.router("net-router-stuck", [stuck], [shared.decode]),
        "stuck-fail": cluster.router("net-router-stuck-fail", [stuck], [fail_decode]),
        "other-model": cluster.router("net-router-other-model", [other_model], [shared.decode]),
        "wrong-token": cluster.router("net-router-wrong-token", [wrong_token], [shared.decode]),
    }
    cluster.wait_serving()
    clients = {name: Client(router.address) for name, router in routers.items()}
    yield Env(shared.decode, fail_decode, stuck, other_model, wrong_token, clients)
    for client in clients.values():
        client.close()


@pytest.fixture
def ready(env) -> Env:
    for client in env.clients.values():
        settle(client, env.engines)
    return env


def _want(tiny_llm, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return tiny_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def _generate(client: Client, prompt: list[int]):
    start = time.monotonic()
    completion = client.generate(
        prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=BOUND_S
    )
    return completion, time.monotonic() - start


def test_stalled_transfer_ends_at_decode_timeout_and_recomputes(ready, tiny_llm, tokenizer):
    env = ready
    failed_before = engine_stats(env.decode.address)["num_loads_failed"]
    prompt = fresh_prompt(tokenizer)
    completion, seconds = _generate(env.clients["stuck"], prompt)
    assert completion.finish_reason == "length"
    assert completion.token_ids == _want(tiny_llm, prompt)
    assert seconds >= TRANSFER_TIMEOUT_S, "decode did not wait for the transfer"
    assert engine_stats(env.decode.address)["num_loads_failed"] == failed_before + 1
    wait_idle(env.engines)


def test_stalled_transfer_with_fail_policy_ends_with_a_clear_error(ready, tokenizer):
    env = ready
    client = env.clients["stuck-fail"]
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        _generate(client, fresh_prompt(tokenizer))
    assert TRANSFER_TIMEOUT_S <= time.monotonic() - start < BOUND_S
    assert engine_stats(env.fail_decode.address)["num_loads_failed"] >= 1
    healthy = router_health(client)[env.fail_decode.address]
    wait_idle(env.engines)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "KV transfer" in info.value.details(), info.value.details()
    assert healthy, "the router took the decode engine out of rotation for a failed transfer"


def test_handshake_with_another_model_is_refused_and_decode_recomputes(ready, tiny_llm, tokenizer):
    env = ready
    failed_before = engine_stats(env.decode.address)["num_loads_failed"]
    expired_before = engine_stats(env.other_model.address)["num_leases_expired"]
    prompt = fresh_prompt(tokenizer)
    completion, _ = _generate(env.clients["other-model"], prompt)
    assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
    # The first token is the 3-layer prefill's; decode recomputed the rest with its own model.
    first = completion.token_ids[:1]
    assert completion.token_ids[1:] == _want(tiny_llm, prompt + first, MAX_TOKENS - 1)
    assert engine_stats(env.decode.address)["num_loads_failed"] == failed_before + 1
    log = env.decode.log_text()
    assert "KV layout mismatch" in log and "'num_layers': 3" in log, env.decode.log_tail()
    wait_idle(env.engines)
    # Decode told the other engine to release its blocks although it refused them.
    assert engine_stats(env.other_model.address)["num_leases_expired"] == expired_before


def test_wrong_cluster_token_is_refused_and_decode_recomputes(ready, tiny_llm, tokenizer):
    env = ready
    failed_before = engine_stats(env.decode.address)["num_loads_failed"]
    expired_before = engine_stats(env.wrong_token.address)["num_leases_expired"]
    prompt = fresh_prompt(tokenizer)
    completion, _ = _generate(env.clients["wrong-token"], prompt)
    assert completion.finish_reason == "length"
    assert completion.token_ids == _want(tiny_llm, prompt)
    assert engine_stats(env.decode.address)["num_loads_failed"] == failed_before + 1
    assert "authentication failed" in env.decode.log_text(), env.decode.log_tail()
    assert "authentication failed" in env.wrong_token.log_text(), env.wrong_token.log_tail()
    # Its release is refused too: the prefill engine frees the blocks when their lease runs out.
    wait_idle(env.engines)
    assert engine_stats(env.wrong_token.address)["num_leases_expired"] == expired_before + 1


# ---------------------------------------------------------------------- the KV data port

_LEN = struct.Struct(">I")


def _data_port(prefill: Proc, token: str, fingerprint: dict) -> tuple[str, int]:
    """Where the prefill engine's tcp transport serves reads (learnt by a proper handshake)."""
    client = SideChannelClient(HOST, prefill.kv_port, token=token)
    try:
        reply = client.request(
            {
                "type": "handshake",
                "version": PD_CONNECTOR_VERSION,
                "engine_id": "probe",
                "fingerprint": fingerprint,
            },
            timeout_s=5,
        )
    finally:
        client.close()
    metadata = reply["transport_metadata"]
    return metadata["host"], metadata["port"]


def test_kv_data_port_refuses_a_reader_without_the_cluster_token(cluster, shared, tiny_llm):
    host, port = _data_port(shared.prefill, cluster.token, tiny_llm.engine.kv_cache_spec.fingerprint())
    with socket.create_connection((host, port), timeout=5) as sock:
        body = msgpack.packb({"tid": "intruder-1", "reader": "intruder", "runs": [[0, 1]]})
        sock.sendall(_LEN.pack(len(body)) + body)
        reader = sock.makefile("rb")
        head = reader.read(4)
        header = msgpack.unpackb(reader.read(_LEN.unpack(head)[0])) if len(head) == 4 else None
    assert header is None or header.get("ok") is False, f"served an unauthenticated reader: {header}"
    assert engine_stats(shared.prefill.address)["healthy"]
