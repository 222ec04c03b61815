"""End to end through gRPC: client -> router -> prefill engine -> KV transfer -> decode engine.

Every process is real (``LocalCluster``: ``pdserve prefill|decode|router`` as subprocesses on
ports picked free at run time), on the tiny model. Greedy outputs must equal the colocated
engine's; the first token must reach the client before decode has done anything; an abort or
a cancel must leave no KV block referenced or held on any engine; a dead engine must give
UNAVAILABLE rather than a hang; bad input must give INVALID_ARGUMENT with a clear message.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import LLM
from pdserve.client import Client
from pdserve.cluster import ClusterError, LocalCluster, pick_free_ports
from pdserve.engine.request import SamplingParams
from pdserve.v1 import engine_pb2_grpc
from tests.helpers.cluster import (
    LONG_ANSWER_ENGINE_ARGS,
    LONG_ANSWER_MAX_MODEL_LEN,
    TINY_ENGINE_ARGS,
    frozen,
    is_idle,
    next_within,
    pid_gone,
    wait_idle,
)
from tests.helpers.text_corpus import long_text, prompts_of_lengths

MAX_TOKENS = 8
# Short prompts run on decode alone (conditional disaggregation), the rest go through prefill.
PROMPT_LENGTHS = [3, 9, 16, 17, 31, 33, 40, 48, 64, 80, 100, 150, 230, 333, 500, 700]
# A bound for calls that must fail fast or finish; hitting it (DEADLINE_EXCEEDED) is a hang.
CALL_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def prompts(tiny_llm) -> list[list[int]]:
    return prompts_of_lengths(tiny_llm.tokenizer, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def expected(tiny_llm, prompts) -> list[list[int]]:
    completions = tiny_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [c.token_ids for c in completions]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trace") / "trace.jsonl")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, trace_file):
    """1 prefill + 1 decode (transport ``auto``): shared by every test that leaves it intact."""
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, router_args=["--trace-file", trace_file]
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


def _generate_all(client: Client, prompts: list[list[int]]) -> list:
    """Send every prompt at once, one thread each."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(
                client.generate,
                prompt_token_ids=p,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                timeout=CALL_TIMEOUT_S,
            )
            for p in prompts
        ]
        return [f.result() for f in futures]


_fresh_prompts = itertools.count()


def _fresh_prompt(tokenizer, num_tokens: int = 80) -> list[int]:
    """A prompt no engine has seen (its first block differs from every other prompt's), well
    above the disaggregation threshold: the router sends it through prefill, since neither
    the decode engine's prefix cache nor anything else can cover it."""
    k = next(_fresh_prompts)
    ids = tokenizer.encode(f"Note {k} of {os.getpid()}: " + long_text(num_tokens * 6, start=k))
    return ids[:num_tokens]


def _assert_all_idle(client: Client, roles: tuple[str, ...] = ("prefill", "decode")) -> None:
    stats = wait_idle(client, roles=roles)
    assert stats and all(is_idle(s) for s in stats), stats


# ---------------------------------------------------------------------- correctness


def test_1p1d_greedy_matches_colocated_for_16_concurrent_prompts(client, cluster, prompts, expected):
    completions = _generate_all(client, prompts)
    assert [c.token_ids for c in completions] == expected
    assert all(c.finish_reason == "length" for c in completions)
    disaggregated = [c for c in completions if c.metrics["prefill_engine"]]
    assert disaggregated, "no prompt went through the prefill engine"
    for c in disaggregated:
        assert c.metrics["prefill_engine"] == cluster.prefill_addresses[0]
        assert c.metrics["decode_engine"] == cluster.decode_addresses[0]
        assert c.metrics["ttft_ms"] > 0 and c.metrics["transfer_ms"] > 0
    _assert_all_idle(client)


def test_a_prompt_decode_has_cached_skips_prefill_the_second_time(client, tiny_llm):
    prompt = _fresh_prompt(tiny_llm.tokenizer, 200)
    first = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert first.metrics["prefill_engine"] and not again.metrics["prefill_engine"]
    assert again.token_ids == first.token_ids
    assert again.metrics["num_cached_tokens"] >= 192  # decode's prefix cache served the prompt


SAMPLED = {
    "seeded": {"temperature": 1.0, "seed": 1234},
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.3},
    "seeded_min_p_and_penalties": {"temperature": 0.8, "seed": 7, "min_p": 0.05, "frequency_penalty": 1.0},
    "min_tokens": {"min_tokens": 6, "stop_token_ids": [2]},
}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampling_parameters_give_the_colocated_tokens_through_prefill_and_decode(
    client, tiny_llm, prompts, case
):
    """The prefill engine draws token 0 and the decode engine the rest: seeded draws and
    penalties (which count the prefill's token as output) must not notice the split."""
    fields = SAMPLED[case]
    fresh = _fresh_prompt(tiny_llm.tokenizer, 200)
    for prompt in (prompts[0], fresh):  # decode alone, and through prefill
        expected = tiny_llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **fields))[0]
        got = client.generate(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout=CALL_TIMEOUT_S, **fields
        )
        assert got.token_ids == expected.token_ids, (case, len(prompt))
        assert bool(got.metrics["prefill_engine"]) == (prompt is fresh)
    _assert_all_idle(client)


@pytest.mark.slow
def test_2p2d_greedy_matches_colocated_and_spreads_over_engines(tiny_model_dir, prompts, expected):
    with (
        LocalCluster(
            2,
            2,
            model=tiny_model_dir,
            kv_transport="tcp",
            policy="round_robin",
            engine_args=TINY_ENGINE_ARGS,
            router_args=["--disagg-min-tokens", "0"],  # every prompt through prefill
        ) as cluster,
        Client(cluster.router_address) as client,
    ):
        completions = _generate_all(client, prompts)
        assert [c.token_ids for c in completions] == expected
        assert {c.metrics["prefill_engine"] for c in completions} == set(cluster.prefill_addresses)
        assert {c.metrics["decode_engine"] for c in completions} <= set(cluster.decode_addresses)
        stats = wait_idle(client)
        assert len(stats) == 4 and all(is_idle(s) for s in stats), stats


# ---------------------------------------------------------------------- streaming order


# A disaggregated request's events in causal order (one host, one clock): each one happens
# because of the one before it.
HANDOVER_EVENTS = [
    "router.receive",
    "prefill.front_received",
    "prefill.received",
    "prefill.admitted",
    "prefill.scheduled",
    "prefill.first_token",
    "prefill.finished",
    "prefill.lease_registered",
    "router.first_token",
    "router.prefill_answer",
    "decode.front_received",
    "decode.received",
    "decode.admitted",
    "decode.pull_start",
    "decode.pull_end",
    "decode.released",
    "decode.load_done",
    "decode.scheduled",
    "decode.first_token",
    "router.decode_first_token",
    "router.done",
]


def test_final_message_and_trace_file_carry_the_handover_timeline_in_order(client, tiny_llm, trace_file):
    out = client.generate(
        prompt_token_ids=_fresh_prompt(tiny_llm.tokenizer),
        max_tokens=4,
        ignore_eos=True,
        timeout=CALL_TIMEOUT_S,
    )
    timeline = out.metrics["timeline_ms"]
    assert out.metrics["decode_engine"] and out.metrics["prefill_engine"], out.metrics
    assert [e for e in HANDOVER_EVENTS if e not in timeline] == []
    times = [timeline[e] for e in HANDOVER_EVENTS]
    assert times == sorted(times), sorted(timeline.items(), key=lambda item: item[1])
    assert timeline["router.receive"] == 0.0
    # Not in the causal chain above: decode may finish before its first token reaches the router.
    assert timeline["decode.first_token"] <= timeline["decode.finished"] <= timeline["router.done"]
    with open(trace_file) as f:
        traces = {record["request_id"]: record for record in map(json.loads, f)}
    assert set(traces[out.request_id]["timeline_ms"]) == set(timeline)
    assert traces[out.request_id]["decode_engine"] == out.metrics["decode_engine"]


def test_first_token_reaches_client_while_decode_engine_is_frozen(client, cluster, tiny_llm):
    """TTFT does not wait for the KV transfer: with the decode engine stopped (SIGSTOP), the
    prefill's token still streams out; decode's tokens follow once it runs again."""
    prompt = _fresh_prompt(tiny_llm.tokenizer)
    want = tiny_llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    stream = client.stream(
        prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=CALL_TIMEOUT_S
    )
    with frozen(cluster.procs["decode-0"].pid):
        first = next_within(stream, timeout_s=30.0)
    rest = list(stream)
    assert first.token_ids == want[:1]
    assert first.finish_reason is None and first.metrics == {}
    assert rest, "decode's tokens never came"
    assert [t for d in rest for t in d.token_ids] == want[1:]
    assert all(d.finish_reason is None for d in rest[:-1]) and rest[-1].finish_reason == "length"
    metrics = rest[-1].metrics
    assert metrics["prefill_engine"] == cluster.prefill_addresses[0]
    assert metrics["decode_engine"] == cluster.decode_addresses[0]
    _assert_all_idle(client)


# ---------------------------------------------------------------------- abort


def _drain(stream) -> tuple[list[int], str | None, grpc.StatusCode | None]:
    tokens, finish_reason = [], None
    try:
        for delta in stream:
            tokens += delta.token_ids
            finish_reason = delta.finish_reason or finish_reason
    except grpc.RpcError as exc:
        return tokens, finish_reason, exc.code()
    return tokens, finish_reason, None


@pytest.mark.parametrize("how", ["abort_rpc", "close_stream"])
def test_abort_mid_stream_frees_blocks_on_both_engines(client, cluster, tiny_llm, how):
    # The decode engine is stopped while the abort goes out (it takes the cancel once resumed),
    # and the request is as long as max_model_len allows. Still, on a busy CI box a test worker
    # was once descheduled while the tiny model streamed all ~940 tokens into its buffer: the
    # request had finished before the Abort RPC, which the router then rightly answered "not
    # running". Only that case (the stream ran to its length) starts over with a new request.
    for attempt in range(3):
        request_id = f"abort-mid-stream-{how}-{attempt}"
        prompt = _fresh_prompt(tiny_llm.tokenizer)
        max_tokens = 1024 - len(prompt) - 1  # as long as max_model_len allows
        stream = client.stream(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            request_id=request_id,
            timeout=CALL_TIMEOUT_S,
        )
        received = [next_within(stream, 30.0) for _ in range(3)]  # the prefill's token, then decode's
        num_received = sum(len(d.token_ids) for d in received)
        assert num_received >= 3
        if how == "close_stream":
            stream.close()
            break
        with frozen(cluster.procs["decode-0"].pid):
            aborted = client.abort(request_id, timeout=10.0)
        tokens, finish_reason, code = _drain(stream)
        if not aborted and finish_reason == "length" and len(tokens) + num_received == max_tokens:
            continue  # it had finished before the abort: not the case under test
        assert aborted is True
        assert finish_reason != "length" and len(tokens) + num_received < max_tokens
        assert finish_reason == "abort" or code == grpc.StatusCode.CANCELLED, (finish_reason, code)
        break
    else:
        pytest.fail("every request finished before its Abort RPC reached the router")
    _assert_all_idle(client)
    assert client.abort(request_id) is False  # the router has forgotten it


def test_abort_during_handover_frees_held_blocks_and_stops_the_request(client, cluster, tiny_llm):
    """Abort after the prefill finished (its blocks held under a lease for decode) while the
    decode engine cannot answer: the prefill frees the held blocks at once (not when the lease
    runs out), and the request does not go on once the decode engine is back."""
    request_id = "abort-during-handover"
    max_tokens = 400
    stream = client.stream(
        prompt_token_ids=_fresh_prompt(tiny_llm.tokenizer),
        max_tokens=max_tokens,
        ignore_eos=True,
        request_id=request_id,
        timeout=CALL_TIMEOUT_S,
    )
    with frozen(cluster.procs["decode-0"].pid):
        first = next_within(stream, 30.0)
        assert len(first.token_ids) == 1
        # Let the router hand the request to the (frozen) decode engine before aborting: the
        # abort then races the decode engine's Generate.
        time.sleep(0.5)
        assert client.abort(request_id, timeout=10.0) is True
        # Well inside the 30 s lease.
        _assert_all_idle(client, roles=("prefill",))
    tokens, finish_reason, code = _drain(stream)
    assert finish_reason != "length" and len(tokens) + 1 < max_tokens, (
        f"the aborted request ran on once decode was back ({len(tokens)} more tokens, {finish_reason})"
    )
    _assert_all_idle(client)


# ---------------------------------------------------------------------- bad input


def _bad_inputs(vocab_size: int) -> dict[str, tuple[dict, str]]:
    """{case: (generate kwargs, what the error message must mention)}."""
    return {
        "empty_prompt": ({"prompt": ""}, "empty"),
        "empty_token_ids": ({"prompt_token_ids": []}, "empty"),
        "prompt_too_long": ({"prompt_token_ids": [5] * 1024}, "max_model_len"),
        "token_outside_vocab": ({"prompt_token_ids": [1, 2, vocab_size + 7]}, "vocabulary"),
        "stop_token_outside_vocab": ({"prompt": "Hello", "stop_token_ids": [vocab_size]}, "stop_token_ids"),
        "several_mb_of_text": ({"prompt": "lorem ipsum " * 300_000}, "bytes"),
        "two_million_token_ids": ({"prompt_token_ids": [5] * 2_000_000}, "max_model_len"),
    }


# Sampling values the Python client refuses itself (ValueError, nothing sent); sent anyway as raw
# protobuf, the router must refuse them too. An explicit zero is not "unset": max_tokens=0 must
# not silently become the default of 16.
BAD_SAMPLING = {
    "zero_max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "negative_temperature": ({"temperature": -1.0}, "temperature"),
    "top_p_above_one": ({"top_p": 2.0}, "top_p"),
    "top_p_zero": ({"top_p": 0.0}, "top_p"),
    "top_k_zero": ({"top_k": 0}, "top_k"),
    "bad_top_k": ({"top_k": -5}, "top_k"),
    "zero_repetition_penalty": ({"repetition_penalty": 0.0}, "repetition_penalty"),
    "presence_penalty_out_of_range": ({"presence_penalty": 3.0}, "presence_penalty"),
    "frequency_penalty_out_of_range": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "min_p_above_one": ({"min_p": 1.5}, "min_p"),
    "min_tokens_above_max_tokens": ({"max_tokens": 4, "min_tokens": 9}, "min_tokens"),
}

BAD_INPUT_CASES = list(_bad_inputs(0))


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_gives_invalid_argument_with_clear_message(client, tiny_llm, case):
    kwargs, mentions = _bad_inputs(tiny_llm.tokenizer.vocab_size)[case]
    with pytest.raises(grpc.RpcError) as info:
        client.generate(max_tokens=4, timeout=CALL_TIMEOUT_S, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert mentions in info.value.details(), info.value.details()


@pytest.mark.parametrize("case", list(BAD_SAMPLING))
def test_bad_sampling_value_is_refused_by_the_client_and_by_the_router(cluster, client, case):
    fields, mentions = BAD_SAMPLING[case]
    with pytest.raises(ValueError, match=mentions):
        client.generate(prompt="Hello", **{"max_tokens": 4, **fields})

    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingParams(**fields))
    with grpc.insecure_channel(cluster.router_address) as channel, pytest.raises(grpc.RpcError) as info:
        list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert mentions in info.value.details(), info.value.details()


def test_unset_max_tokens_means_sixteen_over_raw_grpc(cluster):
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingParams(ignore_eos=True))
    with grpc.insecure_channel(cluster.router_address) as channel:
        messages = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S))
    assert sum(len(m.token_ids) for m in messages) == 16


def test_cluster_still_serves_and_holds_no_blocks_after_bad_input(client, prompts, expected):
    completion = client.generate(prompt_token_ids=prompts[-1], max_tokens=MAX_TOKENS, ignore_eos=True)
    assert completion.token_ids == expected[-1]
    _assert_all_idle(client)


# ---------------------------------------------------------------------- failures


def test_dead_decode_engine_gives_unavailable_not_a_hang(tiny_model_dir, tiny_llm, prompts):
    with (
        LocalCluster(
            1, 1, model=tiny_model_dir, kv_transport="tcp", engine_args=LONG_ANSWER_ENGINE_ARGS
        ) as cluster,
        Client(cluster.router_address) as client,
    ):
        decode = cluster.procs["decode-0"]
        prompt = _fresh_prompt(tiny_llm.tokenizer)
        in_flight = client.stream(
            prompt_token_ids=prompt,
            max_tokens=LONG_ANSWER_MAX_MODEL_LEN - len(prompt) - 1,
            ignore_eos=True,
            timeout=CALL_TIMEOUT_S,
        )
        next_within(in_flight, 30.0)
        next_within(in_flight, 30.0)  # decode is generating
        decode.popen.kill()
        decode.popen.wait()

        _, finish_reason, code = _drain(in_flight)
        assert code == grpc.StatusCode.UNAVAILABLE, (finish_reason, code)
        for prompt in (_fresh_prompt(tiny_llm.tokenizer), prompts[0]):  # through prefill, and decode-only
            with pytest.raises(grpc.RpcError) as info:
                client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, timeout=CALL_TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "decode" in info.value.details()
        # The surviving prefill engine holds nothing for the dead decode.
        _assert_all_idle(client, roles=("prefill",))
        decode_stats = [s for s in client.stats() if s["role"] == "decode"]
        assert [s["healthy"] for s in decode_stats] == [False]
        with pytest.raises(ClusterError, match="decode-0 .* was killed by SIGKILL"):
            cluster.check()


@pytest.mark.slow
def test_decode_engine_killed_mid_stream_is_resumed_on_the_other_with_the_same_tokens(
    tiny_model_dir, tiny_llm
):
    """kill -9 of the decode engine streaming an answer: the router resumes the rest on the
    other decode engine (which computes prompt + streamed tokens itself), so the client's stream
    goes on and ends with exactly the colocated greedy tokens."""
    prompt = _fresh_prompt(tiny_llm.tokenizer)
    max_model_len = LONG_ANSWER_MAX_MODEL_LEN
    max_tokens = max_model_len - len(prompt) - 1
    long_llm = LLM(tiny_model_dir, max_model_len=max_model_len, num_blocks=300, max_num_batched_tokens=1024)
    want = long_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids
    with (
        LocalCluster(
            1, 2, model=tiny_model_dir, kv_transport="tcp", engine_args=LONG_ANSWER_ENGINE_ARGS
        ) as cluster,
        Client(cluster.router_address) as client,
    ):
        stream = client.stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, timeout=CALL_TIMEOUT_S
        )
        streamed = [t for _ in range(3) for t in next_within(stream, 30.0).token_ids]  # decode is generating
        (serving,) = [s["address"] for s in client.stats() if s["role"] == "decode" and s["num_running"] == 1]
        victim = cluster.procs[f"decode-{cluster.decode_addresses.index(serving)}"]
        victim.popen.kill()
        victim.popen.wait()

        deltas = list(stream)
        tokens = streamed + [t for d in deltas for t in d.token_ids]
        assert tokens == want
        assert deltas[-1].finish_reason == "length"
        (survivor,) = set(cluster.decode_addresses) - {serving}
        assert deltas[-1].metrics["decode_engine"] == survivor
        router_metrics = cluster.procs["router"].metrics_address
        metrics = urllib.request.urlopen(f"http://{router_metrics}/metrics", timeout=10).read()
        assert b"pdserve_router_decode_resumed_total 1.0" in metrics
        _assert_all_idle(client, roles=("prefill",))
        (survivor_stats,) = [s for s in client.stats() if s["address"] == survivor]
        assert is_idle(survivor_stats), survivor_stats


class _ShuttingDownDecodeEngine(engine_pb2_grpc.EngineServicer):
    """A decode engine as a router sees it in the instant its gRPC server stops after a
    drain: health says SERVING (the router has not polled since), but every call (Generate,
    Session) gets CANCELLED, the status gRPC gives a call that arrives while its server shuts down."""

    def __init__(self, real_address: str) -> None:
        self.real = grpc.insecure_channel(real_address)
        self.generate_calls = 0

    def Info(self, request, context):
        info = engine_pb2_grpc.EngineStub(self.real).Info(request, timeout=10)
        info.session_port = 0  # not the real engine's framed Session stream: this one's RPC
        return info

    def Stats(self, request, context):
        return engine_pb2_grpc.EngineStub(self.real).Stats(request, timeout=10)

    def Generate(self, request, context):
        self.generate_calls += 1
        context.abort(grpc.StatusCode.CANCELLED, "Server shutdown")

    def Session(self, request_iterator, context):  # the router's way in: as Generate
        next(request_iterator)
        self.generate_calls += 1
        context.abort(grpc.StatusCode.CANCELLED, "Server shutdown")


def _all_healthy(client: Client, num_engines: int) -> bool:
    try:
        stats = client.stats()
    except grpc.RpcError:
        return False  # the router is still starting
    return len(stats) == num_engines and all(s["healthy"] for s in stats)


def test_engine_that_cancels_a_call_before_any_output_is_retried_on_another(cluster, client, tiny_llm):
    """A request must not fail because it reached a decode engine in the moment its server
    stopped (CI saw it once in a rolling restart): the router retries it elsewhere."""
    fake = _ShuttingDownDecodeEngine(cluster.decode_addresses[0])
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    fake_port, router_port = pick_free_ports("127.0.0.1", 2)
    server.add_insecure_port(f"127.0.0.1:{fake_port}")
    server.start()
    router = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve", "router",
            "--port", str(router_port),
            "--model", cluster.model,
            "--prefill", cluster.prefill_addresses[0],
            "--decode", f"127.0.0.1:{fake_port},{cluster.decode_addresses[0]}",
            "--policy", "round_robin",
            "--disagg-min-tokens", "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        with Client(f"127.0.0.1:{router_port}") as second:
            deadline = time.monotonic() + 60
            while not _all_healthy(second, 3) and time.monotonic() < deadline:
                time.sleep(0.2)
            for prompt in (_fresh_prompt(tiny_llm.tokenizer) for _ in range(4)):
                via_fake = second.generate(
                    prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=CALL_TIMEOUT_S
                )
                direct = client.generate(
                    prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=CALL_TIMEOUT_S
                )
                assert via_fake.token_ids == direct.token_ids
                assert via_fake.metrics["decode_engine"] == cluster.decode_addresses[0]
        router.terminate()
        assert fake.generate_calls >= 1, router.communicate(timeout=30)[0]
    finally:
        router.terminate()
        router.wait(30)
        server.stop(0)
        fake.real.close()
    _assert_all_idle(client)


# ---------------------------------------------------------------------- the command


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _pdserve_command(pid: int) -> str | None:
    """The pdserve subcommand process ``pid`` runs (``python -m pdserve ... router``), if any."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [part.decode() for part in f.read().split(b"\0")]
    except OSError:
        return None
    if "pdserve" not in argv:
        return None
    return next((a for a in argv if a in ("router", "prefill", "decode", "cluster")), None)


def _wakeups(pid: int) -> int:
    """How many times the main thread of ``pid`` has been switched to (its loop's wake-ups)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


def _gauge(metrics_url: str, name: str) -> float:
    """The value of the one sample of ``name`` at a Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return float(next(line for line in text.splitlines() if line.startswith(name + "{")).rsplit(" ", 1)[1])


def _finished(metrics_url: str) -> dict[str, float]:
    """``pdserve_engine_requests_finished_total`` by finish reason at a Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        re.search(r'finish_reason="([^"]*)"', line).group(1): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_engine_requests_finished_total{")
    }


def _start_command(args: list[str]) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "cluster", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _read_until(lines: queue.Queue, pattern: str, timeout_s: float) -> tuple[re.Match | None, str]:
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match, "".join(seen)
    return None, "".join(seen)


def test_cluster_command_serves_then_stops_everything_on_sigterm(tiny_model_dir, tmp_path):
    port = pick_free_ports("127.0.0.1", 1)[0]
    proc, lines = _start_command(
        [
            "--model", tiny_model_dir,
            "--port", str(port),
            "--kv-transport", "tcp",
            "--engine-args", " ".join(LONG_ANSWER_ENGINE_ARGS),  # a stream that decodes ~3 s
            "--log-dir", str(tmp_path),
        ]
    )  # fmt: skip
    try:
        match, output = _read_until(lines, r"pdserve cluster ready: router on (\S+)", timeout_s=180)
        assert match, output
        assert match.group(1) == f"127.0.0.1:{port}"
        for name in ("prefill-0", "decode-0", "router"):
            assert re.search(
                rf"^{name}\s+\S+\s+127\.0\.0\.1:\d+\s+http://127\.0\.0\.1:\d+/metrics", output, re.M
            ), output
        decode_metrics = re.search(r"^decode-0\s+\S+\s+\S+\s+(http://\S+/metrics)", output, re.M).group(1)
        with Client(match.group(1)) as client:
            completion = client.generate(
                prompt="The capital of France is", max_tokens=4, timeout=CALL_TIMEOUT_S
            )
            # The decode engine's scheduler gauges are read from its core at the scrape: a
            # stream that has its decode's tokens coming shows as running at once.
            stream = client.stream(
                prompt="Once upon a time", max_tokens=LONG_ANSWER_MAX_MODEL_LEN - 16, ignore_eos=True
            )
            for _ in range(3):  # the prefill's token, then the decode engine's
                next_within(stream, CALL_TIMEOUT_S)
            running = _gauge(decode_metrics, "pdserve_engine_num_running")
            finished = _finished(decode_metrics)
            stream.close()
        assert len(completion.token_ids) >= 1
        assert running == 1.0
        # The engine's core counts what it served (the front is not on a framed session's
        # request path): the completion (a short prompt: decode only) and its tokens.
        assert finished == {completion.finish_reason: 1.0}
        assert _gauge(decode_metrics, "pdserve_engine_generated_tokens_total") >= len(completion.token_ids)
        family = _descendants(proc.pid)  # engines, their cores, the router
        assert len(family) >= 5, family
        # Idle, nothing wakes the supervisor, the router or an engine's front: on a small
        # machine each wake-up of a process with cold caches is CPU taken from the engine cores.
        loops = [proc.pid, *(p for p in family if _pdserve_command(p) in ("router", "prefill", "decode"))]
        assert len(loops) == 4, loops
        time.sleep(1.0)  # the aborted stream's last messages
        before = {pid: _wakeups(pid) for pid in loops}
        time.sleep(3.0)
        woke = {pid: _wakeups(pid) - count for pid, count in before.items() if _wakeups(pid) != count}
        assert not woke, f"woken while idle (pid: wake-ups in 3 s): {woke}"
        assert _gauge(decode_metrics, "pdserve_engine_num_running") == 0.0

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        match, output = _read_until(lines, r"all processes stopped", timeout_s=5)
        assert match, output
        deadline = time.monotonic() + 10
        while not all(pid_gone(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(pid_gone(p) for p in family), [p for p in family if not pid_gone(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _failed_output(proc: subprocess.Popen, lines: queue.Queue, timeout_s: float) -> str:
    """What the command printed, once it exited with code 1 (asserted) and stopped the rest."""
    try:
        code = proc.wait(timeout=timeout_s)
        _, output = _read_until(lines, r"all processes stopped", timeout_s=5)
        assert code == 1, output
        return output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_command_exits_nonzero_naming_a_child_that_dies_while_serving(tiny_model_dir, tmp_path):
    proc, lines = _start_command(
        ["--model", tiny_model_dir, "--engine-args", " ".join(TINY_ENGINE_ARGS), "--log-dir", str(tmp_path)]
    )
    try:
        match, output = _read_until(lines, r"pdserve cluster ready", timeout_s=180)
        assert match, output
        router = next(p for p in _descendants(proc.pid) if _pdserve_command(p) == "router")
        os.kill(router, signal.SIGKILL)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    output = _failed_output(proc, lines, timeout_s=60)
    assert re.search(r"error: router \(\S+\) was killed by SIGKILL", output), output


def test_cluster_command_exits_nonzero_naming_the_engine_that_failed(tmp_path):
    proc, lines = _start_command(["--model", str(tmp_path / "no-such-model"), "--log-dir", str(tmp_path)])
    output = _failed_output(proc, lines, timeout_s=120)
    assert re.search(r"error: (prefill|decode)-0 exited with code \d+ during start-up", output), output
