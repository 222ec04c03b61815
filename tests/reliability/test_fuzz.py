"""Fuzzing a running cluster: random router ``Generate`` requests, garbage on the KV ports.

Every generated request either runs (its first messages are read, then the client cancels, so
a huge ``max_tokens`` costs nothing) or is refused with INVALID_ARGUMENT and a message (or
ALREADY_EXISTS when hypothesis reuses a request id still being torn down); never UNKNOWN,
INTERNAL, UNAVAILABLE or a hang. Garbage sent to a prefill engine's KV side channel and to
its tcp data port is answered or dropped. Afterwards the cluster is healthy, serves, and
holds no KV block.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import struct

import grpc
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import Client
from pdserve.connector.side_channel import SideChannelClient, SideChannelError
from pdserve.connector.transfer_params import PD_CONNECTOR_VERSION
from pdserve.v1 import common_pb2, router_pb2
from tests.helpers.reliability import (
    CALL_TIMEOUT_S,
    HOST,
    engine_prefill,
    engine_stats,
    fresh_prompt,
    router_health,
    settle,
    wait_idle,
)

INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)))  # protobuf strings are UTF-8
MESSAGES_READ = 3  # of a request that runs, before the client cancels it
ACCEPTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}


def _float32() -> st.SearchStrategy[float]:
    # Positive temperatures below ~1e-30 crash the engine core (test_tiny_temperature_... below):
    # kept out of the fuzz so one known bug does not take the shared engines down.
    return st.floats(width=32).filter(lambda x: not 0 < x < 1e-30)


def _requests(vocab_size: int) -> st.SearchStrategy[router_pb2.GenerateRequest]:
    token_ids = st.one_of(
        st.lists(st.integers(0, vocab_size - 1), max_size=64),
        st.lists(st.one_of(INT64, st.integers(vocab_size - 2, vocab_size + 2)), max_size=16),
        st.builds(
            lambda n, t: [t] * n, st.sampled_from([1023, 1024, 4096, 200_000]), st.integers(-1, vocab_size)
        ),
    )
    prompt = st.one_of(
        TEXT.map(lambda s: s[:300]),
        st.sampled_from(
            ["", "\x00", "<|im_start|>user\n<|im_end|>", "\U0001f642" * 400, "x" * ((1 << 20) + 1)]
        ),
    )
    sampling = st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(0, 8), UINT32),
            "temperature": _float32(),
            "top_p": _float32(),
            "top_k": INT32,
            "seed": INT64,
            "stop_token_ids": st.lists(st.one_of(INT64, st.integers(0, vocab_size - 1)), max_size=8),
            "ignore_eos": st.booleans(),
        },
    ).map(lambda fields: common_pb2.SamplingParams(**fields))
    # Mostly one of prompt / prompt_token_ids, as a client would send; sometimes both or neither.
    inputs = st.one_of(
        prompt.map(lambda p: {"prompt": p}),
        token_ids.map(lambda t: {"prompt_token_ids": t}),
        st.fixed_dictionaries({}, optional={"prompt": prompt, "prompt_token_ids": token_ids}),
    )
    return st.builds(
        lambda fields, **rest: router_pb2.GenerateRequest(**fields, **rest),
        inputs,
        request_id=st.one_of(st.just(""), TEXT.map(lambda s: s[:64])),
        sampling=st.one_of(st.none(), sampling),
        priority=INT32,
        apply_chat_template=st.booleans(),
    )


@pytest.fixture(scope="module")
def fuzz_env(shared):
    settle(shared.client, [shared.prefill, shared.decode])
    return shared


def _send(client: Client, request: router_pb2.GenerateRequest) -> str:
    """Send one request; fail unless it runs or is refused with an accepted status + message.
    How it went: "ran" or the status code's name."""
    call = client.stub.Generate(request, timeout=CALL_TIMEOUT_S)
    try:
        for read, _ in enumerate(call, 1):
            if read == MESSAGES_READ:
                call.cancel()
                break
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
        assert code in ACCEPTED, f"{code.name}: {details!r}"
        assert details, f"{code.name} without a message"
        return code.name
    return "ran"


def test_random_generate_requests_get_a_result_or_a_clear_error(fuzz_env, tokenizer):
    client = fuzz_env.client
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=_requests(tokenizer.vocab_size))
    def check(request):
        outcomes[_send(client, request)] += 1

    check()
    print(f"fuzzed Generate requests: {dict(outcomes)}")
    assert outcomes["ran"] and outcomes["INVALID_ARGUMENT"], outcomes
    wait_idle([fuzz_env.prefill, fuzz_env.decode])
    assert all(router_health(client).values())
    completion = client.generate(
        prompt_token_ids=fresh_prompt(tokenizer), max_tokens=4, timeout=CALL_TIMEOUT_S
    )
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4


# ---------------------------------------------------------------------- garbage on the KV ports


def test_side_channel_port_is_the_one_prefill_advertises(fuzz_env, tokenizer):
    params = engine_prefill(
        fuzz_env.prefill.address, "advertised-port", fresh_prompt(tokenizer)
    ).kv_transfer_params
    assert (params.remote_host, params.remote_port) == (HOST, fuzz_env.prefill.kv_port)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.binary(max_size=4096), min_size=1, max_size=4))
def test_garbage_frames_on_the_side_channel_are_refused(fuzz_env, frames):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{fuzz_env.prefill.kv_port}")
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer to a malformed message"
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert reply["ok"] is False and reply["error"], reply
    finally:
        sock.close()


_LEN = struct.Struct(">I")


def _data_port(cluster, prefill, fingerprint: dict) -> tuple[str, int]:
    client = SideChannelClient(HOST, prefill.kv_port, token=cluster.token)
    try:
        reply = client.request(
            {
                "type": "handshake",
                "version": PD_CONNECTOR_VERSION,
                "engine_id": "fuzzer",
                "fingerprint": fingerprint,
            },
            timeout_s=5,
        )
    finally:
        client.close()
    return reply["transport_metadata"]["host"], reply["transport_metadata"]["port"]


@pytest.mark.parametrize("version", [None, PD_CONNECTOR_VERSION - 1, PD_CONNECTOR_VERSION + 1])
def test_a_handshake_of_another_connector_version_is_refused(fuzz_env, cluster, tiny_llm, version):
    message = {
        "type": "handshake",
        "engine_id": "old",
        "fingerprint": tiny_llm.engine.kv_cache_spec.fingerprint(),
    }
    if version is not None:
        message["version"] = version
    client = SideChannelClient(HOST, fuzz_env.prefill.kv_port, token=cluster.token)
    try:
        with pytest.raises(SideChannelError, match="version mismatch"):
            client.request(message, timeout_s=5)
    finally:
        client.close()


def _frame(message: object) -> bytes:
    body = msgpack.packb(message)
    return _LEN.pack(len(body)) + body


GARBAGE = {
    "random-bytes": os.urandom(4096),
    "zmtp-greeting-then-noise": b"\xff" + b"\x00" * 8 + b"\x7f\x03" + os.urandom(512),
    "huge-frame-length": _LEN.pack(0xFFFFFFFF) + b"\x00" * 64,
    "frame-not-msgpack": _LEN.pack(16) + b"\xc1" * 16,
    "frame-not-a-map": _frame([1, 2, 3]),
    "runs-out-of-range": _frame({"tid": "t", "reader": "r", "runs": [[10**9, 5]]}),
    "runs-negative": _frame({"tid": "t", "reader": "r", "runs": [[-1, -1]]}),
    "runs-not-a-list": _frame({"tid": "t", "reader": "r", "runs": "all of them"}),
    "truncated-frame": _LEN.pack(1000) + b"\x80",
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_garbage_on_the_ports_leaves_prefill_serving(fuzz_env, cluster, tiny_llm, tokenizer, garbage):
    prefill = fuzz_env.prefill
    data_port = _data_port(cluster, prefill, tiny_llm.engine.kv_cache_spec.fingerprint())
    for address in ((HOST, prefill.kv_port), data_port):
        # The engine may answer (an error frame), hang up, or wait for more: all are fine.
        with socket.create_connection(address, timeout=1) as sock, contextlib.suppress(OSError):
            sock.sendall(GARBAGE[garbage])
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    failed_before = engine_stats(fuzz_env.decode.address)["num_loads_failed"]
    completion = fuzz_env.client.generate(
        prompt_token_ids=fresh_prompt(tokenizer), max_tokens=4, ignore_eos=True, timeout=CALL_TIMEOUT_S
    )
    assert completion.finish_reason == "length"
    assert completion.metrics["prefill_engine"] == prefill.address
    assert engine_stats(fuzz_env.decode.address)["num_loads_failed"] == failed_before, "the KV pull failed"
    wait_idle([prefill, fuzz_env.decode])


# ---------------------------------------------------------------------- a known crash


@pytest.fixture(scope="module")
def sacrificial(cluster):
    """A decode engine alone behind its own router (every prompt runs on it): it may die."""
    decode = cluster.engine("fuzz-sacrificial-decode", "decode")
    decode.wait_serving()
    router = cluster.router("fuzz-sacrificial-router", [], [decode])
    router.wait_serving()
    with Client(router.address) as client:
        settle(client, [decode])
        yield decode, client


def test_tiny_temperature_neither_crashes_the_engine_nor_fails_the_request(sacrificial, tokenizer):
    decode, client = sacrificial
    try:
        completion = client.generate(
            prompt="Hello there", max_tokens=4, temperature=1e-40, timeout=CALL_TIMEOUT_S
        )
        assert completion.finish_reason
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code().name}: {exc.details()}"
    assert engine_stats(decode.address)["healthy"], "the engine core died"
    assert client.generate(prompt="Still there?", max_tokens=4, timeout=CALL_TIMEOUT_S).finish_reason
