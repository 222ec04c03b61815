"""Abort at every stage of a request's life, by an Abort call or by the client going away.

The stages: queued (waiting in the prefill engine's queue behind other prompts), prefill (in
the middle of a chunked prefill), handover (prefill has answered, decode has not admitted the
request yet), transfer (decode is pulling the KV blocks), decode (tokens are streaming).
Each ends with: the stream over (``abort`` or CANCELLED) short of its max_tokens; every engine
back to zero KV usage and zero held blocks; prefill's held blocks freed by the abort itself, not
by their lease running out; and the router no longer knowing the request.

A stage is pinned, not raced: a long prompt chunked into 2-token steps, a frozen (SIGSTOP)
engine core or decode engine, or a prefill engine whose tcp transport stalls each read 1 s.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from pdserve.client import Client
from tests.helpers.reliability import (
    CALL_TIMEOUT_S,
    Proc,
    Stream,
    engine_stats,
    fresh_prompt,
    generate_request,
    router_in_flight,
    settle,
    wait_for,
    wait_idle,
)

PREFILL_SLOTS = 2
# Two sequences at most, one prompt token each a step: a long prompt takes a thousand steps.
# (Two tokens a step left a 1000-token prompt 0.27 s of prefill once the CPU layer ops were
# vectorised, and a busy CI box once took longer than that between seeing it start and
# freezing the core.)
CHUNKED_PREFILL_ARGS = [
    "--max-num-seqs", str(PREFILL_SLOTS), "--max-num-batched-tokens", "2", "--long-prefill-token-threshold", "1",
]  # fmt: skip
LONG_PROMPT = 1000  # tokens (max_model_len is 1024)
# Every read from this prefill engine stalls 1 s before its payload (below the 2 s timeout).
SLOW_TRANSFER = {"action": "stall", "after_bytes": 0, "stall_s": 1.0}


@dataclass
class Env:
    prefill: Proc  # chunked prefill
    slow_prefill: Proc  # every KV read stalls 1 s
    decode: Proc
    router: Proc
    client: Client  # router: prefill + decode
    slow_client: Client  # router: slow_prefill + decode

    @property
    def engines(self) -> list[Proc]:
        return [self.prefill, self.slow_prefill, self.decode]


@pytest.fixture(scope="module")
def env(cluster, shared):
    prefill = cluster.engine("abort-prefill", "prefill", args=CHUNKED_PREFILL_ARGS)
    slow_prefill = cluster.engine("abort-prefill-slow", "prefill", tcp_fault=SLOW_TRANSFER)
    cluster.wait_serving()
    # Every prompt through prefill, however long the queue there: the stages are prefill's.
    always_pd = ["--max-prefill-queue", "0"]
    router = cluster.router("abort-router", [prefill], [shared.decode], args=always_pd)
    slow_router = cluster.router("abort-router-slow", [slow_prefill], [shared.decode], args=always_pd)
    cluster.wait_serving()
    with Client(router.address) as client, Client(slow_router.address) as slow_client:
        yield Env(prefill, slow_prefill, shared.decode, router, client, slow_client)


@pytest.fixture
def ready(env) -> Env:
    for client in (env.client, env.slow_client):
        settle(client, env.engines)
    return env


# ---------------------------------------------------------------------- the stages


@contextlib.contextmanager
def _queued(env: Env, tokenizer, request_id: str) -> Iterator[Stream]:
    """Waiting in prefill's queue: two long prompts hold both of its sequence slots."""
    ahead = [Stream(env.client, generate_request(fresh_prompt(tokenizer, LONG_PROMPT), 2)) for _ in range(2)]
    wait_for(
        lambda: engine_stats(env.prefill.address)["num_running"] == PREFILL_SLOTS,
        10,
        "prefill's slots to fill",
    )
    target = Stream(env.client, generate_request(fresh_prompt(tokenizer), 8, request_id))
    wait_for(lambda: engine_stats(env.prefill.address)["num_waiting"] == 1, 10, "the request to queue")
    with env.prefill.core_frozen():  # nothing is scheduled until the abort has been queued too
        yield target
    for stream in ahead:  # the requests ahead of it are unaffected
        stream.wait_done(30)
        assert stream.finish_reason == "length" and len(stream.tokens) == 2, (stream.code, stream.details)


@contextlib.contextmanager
def _prefill(env: Env, tokenizer, request_id: str) -> Iterator[Stream]:
    """In the middle of a chunked prefill (about 1000 steps of 1 token)."""
    target = Stream(env.client, generate_request(fresh_prompt(tokenizer, LONG_PROMPT), 8, request_id))
    wait_for(
        lambda: engine_stats(env.prefill.address)["num_running"] == 1,
        10,
        "the prefill to start",
        poll_s=0.005,
    )
    with env.prefill.core_frozen():
        yield target


@contextlib.contextmanager
def _handover(env: Env, tokenizer, request_id: str) -> Iterator[Stream]:
    """Prefill has answered (its blocks are held for decode); decode cannot admit it (frozen)."""
    with env.decode.frozen():
        target = Stream(env.client, generate_request(fresh_prompt(tokenizer), 500, request_id))
        target.wait_tokens(1)
        # The router has sent it on to decode (which can't read it yet).
        wait_for(lambda: router_in_flight(env.router, "decode") == 1, 10, "the router to send it to decode")
        yield target


@contextlib.contextmanager
def _transfer(env: Env, tokenizer, request_id: str) -> Iterator[Stream]:
    """Decode is pulling the KV blocks (the prefill engine stalls every read 1 s)."""
    target = Stream(env.slow_client, generate_request(fresh_prompt(tokenizer), 500, request_id))
    wait_for(
        lambda: engine_stats(env.decode.address)["num_waiting_for_remote_kvs"] == 1,
        10,
        "decode to start pulling",
    )
    yield target


@contextlib.contextmanager
def _decode(env: Env, tokenizer, request_id: str) -> Iterator[Stream]:
    """Decode is streaming tokens."""
    target = Stream(env.client, generate_request(fresh_prompt(tokenizer), 900, request_id))
    target.wait_tokens(3)
    yield target


STAGES = {
    "queued": _queued,
    "prefill": _prefill,
    "handover": _handover,
    "transfer": _transfer,
    "decode": _decode,
}
CASES = [(stage, how) for stage in STAGES for how in ("abort", "disconnect")]


@pytest.mark.parametrize(("stage", "how"), CASES)
def test_abort_at_stage_frees_every_block(ready, tokenizer, stage, how):
    env = ready
    client = env.slow_client if stage == "transfer" else env.client
    prefill = env.slow_prefill if stage == "transfer" else env.prefill
    request_id = f"abort-at-{stage}-by-{how}"
    expired_before = engine_stats(prefill.address)["num_leases_expired"]
    with STAGES[stage](env, tokenizer, request_id) as target:
        if how == "abort":
            assert client.abort(request_id, timeout=10) is True
        else:
            target.cancel()  # the client goes away without an Abort
    target.wait_done(15)
    assert target.aborted, (target.finish_reason, target.code, target.details)
    if stage in ("queued", "prefill"):
        assert target.tokens == [], "aborted before its first token, yet tokens came"
    elif stage in ("handover", "transfer"):
        assert len(target.tokens) == 1, "only prefill's token can have come"
    wait_idle(env.engines)
    # Prefill's blocks were freed by the abort, not left to the lease.
    assert engine_stats(prefill.address)["num_leases_expired"] == expired_before
    assert client.abort(request_id) is False  # the router has forgotten it


# ---------------------------------------------------------------------- clients that vanish


def test_client_closing_its_channel_mid_decode_frees_blocks(ready, tokenizer):
    env = ready
    client = Client(env.client.address)
    target = Stream(client, generate_request(fresh_prompt(tokenizer), 900, "channel-closed"))
    target.wait_tokens(3)
    client.close()
    target.wait_done(15)
    assert target.code == grpc.StatusCode.CANCELLED, (target.finish_reason, target.code)
    wait_idle(env.engines)
    assert env.client.abort("channel-closed") is False


# A client in its own process, printing a line per streamed message.
_CLIENT = """
import sys
from pdserve.client import Client
prompt = [int(t) for t in sys.argv[2].split(",")]
with Client(sys.argv[1]) as client:
    for delta in client.stream(prompt_token_ids=prompt, max_tokens=500, ignore_eos=True, request_id=sys.argv[3]):
        print(len(delta.token_ids), flush=True)
"""


def test_client_process_killed_mid_transfer_frees_blocks(ready, tokenizer):
    """kill -9 of the client: no cancel is sent, the router only sees the connection drop."""
    env = ready
    prompt = ",".join(map(str, fresh_prompt(tokenizer)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, env.slow_client.address, prompt, "client-killed"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert select.select([proc.stdout], [], [], 30)[0], "the client printed nothing within 30 s"
        assert proc.stdout.readline().strip() == "1", "prefill's token did not reach the client"
        wait_for(
            lambda: engine_stats(env.decode.address)["num_waiting_for_remote_kvs"] == 1,
            10,
            "decode to start pulling",
        )
        expired_before = engine_stats(env.slow_prefill.address)["num_leases_expired"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    wait_idle(env.engines)
    assert engine_stats(env.slow_prefill.address)["num_leases_expired"] == expired_before
    assert env.slow_client.abort("client-killed") is False


# ---------------------------------------------------------------------- an unresponsive engine


def test_abort_ends_the_stream_while_the_engine_does_not_answer(ready, tokenizer):
    """The router holds the request (sent to a prefill engine that is frozen): Abort must end
    the client's stream at once, whatever the engine does."""
    env = ready
    request_id = "abort-unresponsive-engine"
    with env.prefill.frozen():
        target = Stream(
            env.client, generate_request(fresh_prompt(tokenizer), 8, request_id), timeout_s=CALL_TIMEOUT_S
        )
        wait_for(lambda: router_in_flight(env.router, "prefill") == 1, 10, "the router to send it to prefill")
        assert env.client.abort(request_id, timeout=10) is True
        ended = target.done.wait(3.0)
    target.wait_done(15)
    wait_idle(env.engines)
    assert ended, "the stream was still open 3 s after Abort returned"
    assert target.aborted and target.tokens == [], (target.finish_reason, target.code, target.tokens)


# ---------------------------------------------------------------------- someone else's abort


def test_same_request_id_through_another_router_leaves_the_running_request_alone(ready, tokenizer):
    """Two routers share the decode engine; a client of the second reuses a request id that is
    running through the first. The newcomer may be refused, but the running request must not
    be aborted by it."""
    env = ready
    request_id = "same-id-two-routers"
    running = Stream(env.client, generate_request(fresh_prompt(tokenizer), 900, request_id))
    running.wait_tokens(3)
    newcomer = Stream(env.slow_client, generate_request(fresh_prompt(tokenizer), 8, request_id)).wait_done(30)
    running.wait_done(30)
    wait_idle(env.engines)
    assert newcomer.finish_reason == "length" or newcomer.code == grpc.StatusCode.ALREADY_EXISTS, (
        newcomer.finish_reason,
        newcomer.code,
        newcomer.details,
    )
    assert (running.finish_reason, running.code) == ("length", None), "the running request was aborted"
    assert len(running.tokens) == 900
