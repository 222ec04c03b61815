"""Process faults: kill -9 of prefill or decode mid-transfer, router restart, engine restart.

What happens to the requests a fault hits (docs/reliability.md's fault table says the same):
- prefill killed while decode pulls from it: decode's read fails and decode recomputes the
  prompt itself (``kv_load_failure_policy=recompute``); the client gets every token, unchanged.
- decode killed while it pulls: the router retries the request on the other decode engine
  (decode had not produced anything yet), which pulls the still-held blocks or recomputes.
- router killed: its streams end with UNAVAILABLE; the engines see their calls cancelled and
  free everything; a restarted router on the same port serves the same clients again.
- engine restarted on the same address: decode redoes the handshake with the new instance.
Requests the fault does not hit complete; the router marks the engine unhealthy, then healthy
again once it is back; nothing leaks on any engine.

This module has its own cluster (one prefill whose tcp reads each stall 1 s, so a transfer can
be caught in flight, and two decode engines), since its tests kill and restart processes.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from pdserve.client import Client
from pdserve.engine.request import SamplingParams
from tests.helpers.reliability import (
    HOST,
    Proc,
    Stream,
    TestCluster,
    engine_prefill,
    engine_stats,
    free_ports,
    fresh_prompt,
    generate_request,
    router_health,
    router_in_flight,
    settle,
    wait_for,
    wait_idle,
)

MAX_TOKENS = 12
SLOW_TRANSFER = {"action": "stall", "after_bytes": 0, "stall_s": 1.0}
HEALTH_CHANGE_S = 10.0  # the router health-checks every second (1 s timeout)


@dataclass
class Env:
    prefill: Proc
    decodes: list[Proc]
    router: Proc
    client: Client
    http_port: int

    @property
    def engines(self) -> list[Proc]:
        return [self.prefill, *self.decodes]


@pytest.fixture(scope="module")
def env(request, tiny_model_dir):
    with TestCluster(tiny_model_dir) as cluster:
        prefill = cluster.engine("faults-prefill", "prefill", tcp_fault=SLOW_TRANSFER)
        decodes = [cluster.engine(f"faults-decode-{i}", "decode") for i in range(2)]
        cluster.wait_serving()
        (http_port,) = free_ports(1)
        router = cluster.router(
            "faults-router",
            [prefill],
            decodes,
            args=["--policy", "least_loaded", "--http-port", str(http_port)],
        )
        router.wait_serving()
        with Client(router.address) as client:
            yield Env(prefill, decodes, router, client, http_port)
        cluster.failed = request.session.testsfailed > 0


@pytest.fixture
def ready(env) -> Env:
    settle(env.client, env.engines)
    return env


def _want(tiny_llm, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return tiny_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def _pulling(decodes: list[Proc]) -> Proc | None:
    """The decode engine with a KV pull in flight, if any."""
    for decode in decodes:
        if engine_stats(decode.address)["num_waiting_for_remote_kvs"]:
            return decode
    return None


def _health_flips(client: Client, engine: Proc, healthy: bool) -> None:
    state = "healthy" if healthy else "unhealthy"
    wait_for(
        lambda: router_health(client)[engine.address] is healthy, HEALTH_CHANGE_S, f"{engine.name} {state}"
    )


def _completes(client: Client, tiny_llm, tokenizer) -> dict:
    """A new request completes with the colocated engine's tokens; its metrics."""
    prompt = fresh_prompt(tokenizer)
    completion = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60)
    assert completion.finish_reason == "length"
    assert completion.token_ids == _want(tiny_llm, prompt)
    return completion.metrics


def test_prefill_killed_mid_transfer_request_is_recomputed_on_decode(ready, tiny_llm, tokenizer):
    env = ready
    # Unaffected: a request already decoding when the fault hits.
    bystander = Stream(env.client, generate_request(fresh_prompt(tokenizer), 900, "bystander"))
    bystander.wait_tokens(2)
    prompt = fresh_prompt(tokenizer)
    target = Stream(env.client, generate_request(prompt, MAX_TOKENS, "prefill-killed"))
    wait_for(lambda: _pulling(env.decodes), 10, "a decode engine to start pulling")
    decode = _pulling(env.decodes)
    failed_before = engine_stats(decode.address)["num_loads_failed"]

    env.prefill.kill9()
    target.wait_done(30)
    assert (target.finish_reason, target.code) == ("length", None), target.details
    assert target.tokens == _want(tiny_llm, prompt), "recomputed output differs from the colocated engine's"
    assert engine_stats(decode.address)["num_loads_failed"] == failed_before + 1
    bystander.wait_done(30)
    assert bystander.finish_reason == "length" and len(bystander.tokens) == 900

    _health_flips(env.client, env.prefill, healthy=False)
    # While prefill is down, new requests run on decode alone (it prefills them itself).
    assert _completes(env.client, tiny_llm, tokenizer)["prefill_engine"] == ""
    wait_idle(env.decodes)

    env.prefill.restart()
    _health_flips(env.client, env.prefill, healthy=True)
    assert _completes(env.client, tiny_llm, tokenizer)["prefill_engine"] == env.prefill.address
    wait_idle(env.engines)


def test_decode_killed_mid_transfer_request_is_retried_on_the_other_decode(ready, tiny_llm, tokenizer):
    env = ready
    prompt = fresh_prompt(tokenizer)
    target = Stream(env.client, generate_request(prompt, MAX_TOKENS, "decode-killed"))
    wait_for(lambda: _pulling(env.decodes), 10, "a decode engine to start pulling")
    victim = _pulling(env.decodes)
    survivor = next(d for d in env.decodes if d is not victim)

    victim.kill9()
    target.wait_done(30)
    assert (target.finish_reason, target.code) == ("length", None), target.details
    assert target.tokens == _want(tiny_llm, prompt)
    # Prefill's blocks held for the dead decode are freed (released by the retry, or the lease).
    wait_idle([env.prefill, survivor])

    _health_flips(env.client, victim, healthy=False)
    assert _completes(env.client, tiny_llm, tokenizer)["decode_engine"] == survivor.address
    victim.restart()
    _health_flips(env.client, victim, healthy=True)
    wait_idle(env.engines)


def test_decode_core_killed_mid_stream_resumes_on_the_other_decode(ready, tiny_llm, tokenizer):
    """Only the engine core dies, its front lives on: the framed session the core was writing
    is closed, the router fails the stream over (UNAVAILABLE) and resumes it on the other
    decode engine, and the client gets every token, unchanged."""
    env = ready
    prompt = fresh_prompt(tokenizer)
    target = Stream(env.client, generate_request(prompt, 200, "decode-core-killed"))
    target.wait_tokens(3)
    victim = next(d for d in env.decodes if engine_stats(d.address)["num_running"])
    survivor = next(d for d in env.decodes if d is not victim)

    for pid in victim.core_pids():
        os.kill(pid, signal.SIGKILL)
    target.wait_done(60)
    assert (target.finish_reason, target.code) == ("length", None), target.details
    assert target.tokens == _want(tiny_llm, prompt, 200)
    _health_flips(env.client, victim, healthy=False)
    wait_idle([env.prefill, survivor])
    victim.restart()
    _health_flips(env.client, victim, healthy=True)
    wait_idle(env.engines)


def _reader_relayed_tokens(router: Proc) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{router.metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('pdserve_router_streamed_tokens_total{path="reader"} '):
                return float(line.split()[-1])
    return 0.0


def test_decode_core_killed_mid_http_stream_resumes_with_every_token(ready, tiny_llm, tokenizer):
    """The same over the OpenAI API's stream, whose tokens the router's session reader writes
    to the client itself: the resumed stream goes on after the last token the client got, with
    none repeated or lost."""
    env = ready
    prompt = fresh_prompt(tokenizer)
    relayed = _reader_relayed_tokens(env.router)
    body = {
        "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True, "return_token_ids": True,
        "temperature": 0.0,
    }  # fmt: skip
    connection = http.client.HTTPConnection(HOST, env.http_port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    ids: list[int] = []
    finish = None
    killed = False
    while finish is None:
        line = response.readline()
        assert line, "the stream ended without a finish reason"
        if not line.startswith(b"data: {"):
            continue
        (choice,) = json.loads(line.removeprefix(b"data: "))["choices"]
        assert "error" not in choice, choice
        ids += choice["token_ids"]
        finish = choice["finish_reason"]
        if len(ids) >= 3 and not killed:
            victim = next(d for d in env.decodes if engine_stats(d.address)["num_running"])
            for pid in victim.core_pids():
                os.kill(pid, signal.SIGKILL)
            killed = True
    connection.close()
    assert killed and finish == "length"
    assert ids == _want(tiny_llm, prompt, 200)
    assert _reader_relayed_tokens(env.router) > relayed  # the stream went the reader's way
    _health_flips(env.client, victim, healthy=False)
    survivor = next(d for d in env.decodes if d is not victim)
    wait_idle([env.prefill, survivor])
    victim.restart()
    _health_flips(env.client, victim, healthy=True)
    wait_idle(env.engines)


def test_router_restart_clients_reconnect_and_engines_keep_nothing(ready, tiny_llm, tokenizer):
    env = ready
    target = Stream(env.client, generate_request(fresh_prompt(tokenizer), 900, "router-killed"))
    target.wait_tokens(3)

    env.router.kill9()
    target.wait_done(10)
    assert target.code == grpc.StatusCode.UNAVAILABLE, (target.finish_reason, target.code)
    # The engines saw their calls cancelled and freed everything, with no router to tell them.
    wait_idle(env.engines)

    env.router.restart()
    # The same client (its channel reconnects by itself) is served again.
    deadline = time.monotonic() + 30
    while True:
        try:
            _completes(env.client, tiny_llm, tokenizer)
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    wait_for(lambda: all(router_health(env.client).values()), HEALTH_CHANGE_S, "every engine healthy")
    wait_idle(env.engines)


def _handshakes(decodes: list[Proc], engine_id: str) -> int:
    return sum(d.log_text().count(f"handshake with {engine_id} at") for d in decodes)


def test_prefill_restarted_on_same_address_redoes_the_handshake(ready, tiny_llm, tokenizer):
    env = ready
    _completes(env.client, tiny_llm, tokenizer)  # decode has shaken hands with this instance
    before = engine_prefill(
        env.prefill.address, "instance-before", fresh_prompt(tokenizer)
    ).kv_transfer_params
    handshakes = _handshakes(env.decodes, env.prefill.name)

    env.prefill.stop()
    _health_flips(env.client, env.prefill, healthy=False)
    env.prefill.restart()
    _health_flips(env.client, env.prefill, healthy=True)

    after = engine_prefill(env.prefill.address, "instance-after", fresh_prompt(tokenizer)).kv_transfer_params
    assert (after.remote_host, after.remote_port) == (before.remote_host, before.remote_port)
    assert after.remote_instance_id != before.remote_instance_id
    stats = {d.name: engine_stats(d.address) for d in env.decodes}
    metrics = _completes(env.client, tiny_llm, tokenizer)
    assert metrics["prefill_engine"] == env.prefill.address
    decode = next(d for d in env.decodes if d.address == metrics["decode_engine"])
    now = engine_stats(decode.address)
    assert now["num_loads_failed"] == stats[decode.name]["num_loads_failed"], (
        "the pull from the new instance failed"
    )
    assert now["num_blocks_pulled"] > stats[decode.name]["num_blocks_pulled"]
    assert _handshakes(env.decodes, env.prefill.name) == handshakes + 1
    wait_idle(env.engines)


def test_request_on_a_prefill_that_dies_is_served_by_decode(ready, tiny_llm, tokenizer):
    env = ready
    prompt = fresh_prompt(tokenizer)
    env.prefill.freeze()  # front and core: it takes the request but never answers
    target = Stream(env.client, generate_request(prompt, MAX_TOKENS, "prefill-died-under-it"))
    try:
        wait_for(lambda: router_in_flight(env.router, "prefill") == 1, 10, "the router to send it to prefill")
    finally:
        env.prefill.kill9()
    target.wait_done(30)
    env.prefill.restart()
    _health_flips(env.client, env.prefill, healthy=True)
    wait_idle(env.engines)
    assert (target.finish_reason, target.code) == ("length", None), (target.code, target.details)
    assert target.tokens == _want(tiny_llm, prompt)
