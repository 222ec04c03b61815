"""The router's OpenAI-compatible HTTP API, driven by the official ``openai`` SDK (sync and async).

One 1P1D cluster on the tiny model serves every test here (``http_port=0``: a free port). The
outputs are held to the colocated engine (``tiny_llm``) and to the gRPC path, token for token
(``return_token_ids``); errors must map to the SDK's exception classes; a client that goes away
must leave every engine with no KV block in use or held.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from pdserve.client import Client
from pdserve.cluster import LocalCluster, pick_free_ports
from pdserve.engine.request import SamplingParams
from pdserve.router import token_relay
from tests.helpers.cluster import TINY_ENGINE_ARGS, frozen, is_idle, wait_idle
from tests.helpers.text_corpus import long_text

MODEL = "tiny"  # --served-model-name
GREEDY = {"temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, router_args=["--served-model-name", MODEL],
        http_port=0,
    ) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(cluster):
    return openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def long_prompt(tiny_llm) -> str:
    """Long enough (~150 tokens) that the router sends it through prefill, then decode."""
    return long_text(600, start=3)


def _assert_idle(grpc_client) -> None:
    stats = wait_idle(grpc_client)
    assert all(is_idle(s) for s in stats), stats


def _aborted_count(cluster) -> float:
    """The router's count of requests that ended aborted (client gone, Abort RPC)."""
    base = cluster.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith('pdserve_router_requests_total{finish_reason="abort"}'):
                return float(line.split()[-1])
    return 0.0


def _reference(tiny_llm, prompt, max_tokens: int) -> list[int]:
    return tiny_llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


# ---------------------------------------------------------------------- models


def test_models_list_and_retrieve(sdk):
    (model,) = sdk.models.list().data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "pdserve"
    assert model.model_extra["max_model_len"] == 1024
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_date_header_is_the_second_of_each_response(cluster):
    """The Date header is made when a response starts (nothing ticks to refresh it while the
    router idles): each response carries its own second, on one kept-alive connection too."""
    base = cluster.http_url.removesuffix("/v1")
    dates = []
    connection = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)
    with contextlib.closing(connection):
        for pause in (0.0, 2.2, 0.0):
            time.sleep(pause)
            before = time.time()
            connection.request("GET", "/health")
            reply = connection.getresponse()
            reply.read()
            after = time.time()
            date = email.utils.parsedate_to_datetime(reply.headers["date"]).timestamp()
            assert int(before) <= date <= after, (before, reply.headers["date"], after)
            dates.append(date)
    assert dates[1] >= dates[0] + 2


# ---------------------------------------------------------------------- completions


def test_completion_of_a_string_equals_colocated_and_grpc(sdk, grpc_client, tiny_llm, long_prompt):
    for prompt in ("The capital of France is", long_prompt):
        reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body=EXTRA, **GREEDY)
        (choice,) = reply.choices
        ids = tiny_llm.tokenizer.encode(prompt)
        expected = _reference(tiny_llm, ids, 12)
        assert choice.model_extra["token_ids"] == expected
        assert choice.text == tiny_llm.tokenizer.decode(expected)
        assert choice.finish_reason == "length"
        via_grpc = grpc_client.generate(prompt=prompt, max_tokens=12, ignore_eos=True)
        assert via_grpc.token_ids == expected
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 12
        assert reply.usage.total_tokens == len(ids) + 12
    _assert_idle(grpc_client)


def test_completion_of_a_batch_of_prompts_and_of_token_ids(sdk, tiny_llm, long_prompt):
    prompts = ["Water boils at", long_prompt, "def fibonacci(n):"]
    reply = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=6, extra_body=EXTRA, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        assert choice.model_extra["token_ids"] == _reference(tiny_llm, tiny_llm.tokenizer.encode(prompt), 6)
    ids = [tiny_llm.tokenizer.encode(p) for p in prompts]
    one = sdk.completions.create(model=MODEL, prompt=ids[1], max_tokens=6, extra_body=EXTRA, **GREEDY)
    assert one.choices[0].model_extra["token_ids"] == reply.choices[1].model_extra["token_ids"]
    many = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=6, extra_body=EXTRA, **GREEDY)
    assert [c.model_extra["token_ids"] for c in many.choices] == [
        c.model_extra["token_ids"] for c in reply.choices
    ]
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_async_client_streams_the_same_tokens(cluster, tiny_llm, long_prompt):
    async def run() -> tuple[str, list[int], str]:
        client = openai.AsyncOpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=60)
        stream = await client.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=10, stream=True, extra_body=EXTRA, **GREEDY
        )
        text, ids, finish = [], [], None
        async for chunk in stream:
            (choice,) = chunk.choices
            text.append(choice.text)
            ids += choice.model_extra["token_ids"]
            finish = choice.finish_reason or finish
        await client.close()
        return "".join(text), ids, finish

    text, ids, finish = asyncio.run(run())
    expected = _reference(tiny_llm, tiny_llm.tokenizer.encode(long_prompt), 10)
    assert ids == expected and finish == "length"
    assert text == tiny_llm.tokenizer.decode(expected)


# ---------------------------------------------------------------------- chat


def test_chat_streamed_deltas_equal_the_non_streamed_content(sdk, grpc_client):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    whole = sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, extra_body=EXTRA, **GREEDY
    )
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(content) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert content[-1] or len(chunks) == 2  # the finish reason rides on the last content chunk
    # The same conversation over gRPC: same tokens.
    via_grpc = grpc_client.generate(messages=messages, max_tokens=12, ignore_eos=True)
    assert via_grpc.token_ids == choice.model_extra["token_ids"]


def test_chat_prompt_is_the_models_template_tokenized_with_its_specials(sdk, tiny_llm):
    """The tiny model's own ChatML template, rendered as transformers does, its special tokens
    parsed as tokens and nothing added (the template writes what the model needs)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=EXTRA)
    rendered = tiny_llm.tokenizer.apply_chat_template(messages)
    assert (
        rendered
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt_ids = reply.model_extra["prompt_token_ids"][0]
    assert prompt_ids == tiny_llm.tokenizer.encode(rendered)
    assert prompt_ids[0] == tiny_llm.tokenizer.token_to_id("<|im_start|>")


def test_chat_default_max_tokens_fills_the_context(sdk):
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True}, **GREEDY
    )
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 1024
    assert reply.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- stop strings, n, seeds, usage


def test_stop_string_ends_the_text_before_it_and_frees_the_engines(sdk, grpc_client, tiny_llm, long_prompt):
    full = sdk.completions.create(model=MODEL, prompt=long_prompt, max_tokens=40, extra_body=EXTRA, **GREEDY)
    text = full.choices[0].text
    stop = _clean_stop_string(text)
    cut = sdk.completions.create(model=MODEL, prompt=long_prompt, max_tokens=40, stop=[stop], **GREEDY)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    assert cut.usage.completion_tokens < 40
    kept = sdk.completions.create(
        model=MODEL,
        prompt=long_prompt,
        max_tokens=40,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = list(
        sdk.completions.create(model=MODEL, prompt=long_prompt, max_tokens=40, stop=[stop], stream=True)
    )
    deltas = [c.choices[0].text for c in streamed]
    assert "".join(deltas) == text[: text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"
    _assert_idle(grpc_client)  # the engines were told to stop generating


def _clean_stop_string(text: str) -> str:
    """Two characters from the middle of ``text`` that occur there first and are whole
    characters (the tiny model emits many bytes that are no UTF-8)."""
    for i in range(8, len(text) - 2):
        stop = text[i : i + 2]
        if "\ufffd" not in stop and stop not in text[: i + 1]:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_n_choices_with_a_seed_are_reproducible(sdk):
    def ask() -> list[str]:
        reply = sdk.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, n=2, temperature=1.0, seed=42,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in reply.choices] == [0, 1]
        assert reply.usage.completion_tokens == 32
        return [c.text for c in reply.choices]

    first = ask()
    assert first == ask()
    assert first[0] != first[1]  # each choice draws its own tokens


def test_stream_include_usage_ends_with_a_usage_chunk(sdk):
    chunks = list(
        sdk.completions.create(
            model=MODEL, prompt="Hello", max_tokens=7, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_sampling_extensions_reach_the_engine_sampler(sdk, tiny_llm):
    prompt = "The river Seine flows through Paris"
    params = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2, "min_tokens": 3}
    reply = sdk.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, frequency_penalty=0.5, presence_penalty=0.2,
        extra_body={**EXTRA, "repetition_penalty": 1.3, "min_tokens": 3}, **GREEDY,
    )  # fmt: skip
    expected = tiny_llm.generate(
        [tiny_llm.tokenizer.encode(prompt)], SamplingParams(max_tokens=10, ignore_eos=True, **params)
    )[0].token_ids
    assert reply.choices[0].model_extra["token_ids"] == expected


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "word " * 3000}, "prompt"),
        ({"max_tokens": 1020}, "max_tokens"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"extra_body": {"min_p": 2.0}}, "min_p"),
    ],
)
def test_bad_completion_fields_get_400_naming_the_field(sdk, fields, param):
    kwargs = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(**kwargs)
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"}
    assert param in error["message"] or error["param"] == param, error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "role"),
        ({"messages": []}, "messages"),
    ],
)
def test_unsupported_chat_fields_get_400_naming_the_field(sdk, fields, param):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(**kwargs)
    assert param in info.value.body["message"]


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def _start_router(cluster, tiny_model_dir, *extra: str, decode: str | None = None):
    port, http_port = pick_free_ports("127.0.0.1", 2)
    argv = [
        sys.executable, "-m", "pdserve", "--log-level", "INFO", "router", "--port", str(port), "--http-port", str(http_port),
        "--model", tiny_model_dir, "--decode", decode or ",".join(cluster.decode_addresses),
        "--prefill", ",".join(cluster.prefill_addresses), "--served-model-name", MODEL, *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", http_port), timeout=1):
                return proc, f"http://127.0.0.1:{http_port}/v1"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"router did not start: {proc.communicate()[0]}")


def test_a_full_router_answers_429(cluster, tiny_model_dir, grpc_client):
    proc, url = _start_router(cluster, tiny_model_dir, "--max-inflight", "1")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        time.sleep(2.0)  # its health check has seen the engines
        with frozen(cluster.procs["decode-0"].pid):
            held = client.completions.create(model=MODEL, prompt="Hello", max_tokens=50, stream=True)
            time.sleep(0.5)
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=MODEL, prompt="Hello again", max_tokens=2)
            assert info.value.body["code"] == "rate_limit_exceeded"
            held.close()
        _assert_idle(grpc_client)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_router_on_asyncios_loop_streams_what_the_default_uvloop_router_does(cluster, tiny_model_dir, sdk):
    """``--event-loop asyncio`` (the escape hatch from the default uvloop): the same stream."""

    def streamed(client: openai.OpenAI) -> str:
        stream = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, stream=True
        )
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    proc, url = _start_router(cluster, tiny_model_dir, "--event-loop", "asyncio")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        time.sleep(2.0)  # its health check has seen the engines
        on_asyncio = streamed(client)
        assert on_asyncio and on_asyncio == streamed(sdk)
    finally:
        proc.terminate()
        log = proc.communicate(timeout=10)[0]
    assert "asyncio event loop)" in log
    with open(os.path.join(cluster.log_dir, "router.log")) as default_log:
        assert "uvloop event loop)" in default_log.read()


def test_no_engine_to_serve_is_503(cluster, tiny_model_dir):
    dead = f"127.0.0.1:{pick_free_ports('127.0.0.1', 1)[0]}"
    proc, url = _start_router(cluster, tiny_model_dir, decode=dead)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert info.value.status_code == 503
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health") as response:
            pytest.fail(f"/health answered {response.status} with no decode engine")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------------- disconnects


def _wait_aborted(cluster, count: float, timeout_s: float = 30.0) -> float:
    """The router's abort count once it reaches ``count`` (or what it is after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (seen := _aborted_count(cluster)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_closing_a_stream_aborts_the_request_on_every_engine(cluster, sdk, grpc_client, long_prompt):
    aborted = _aborted_count(cluster)
    # The decode engine is stopped while the stream is open and closes: with it running, the
    # tiny model could finish all 400 tokens before the client had closed (the router then had
    # nothing left to abort: the request ended "length").
    with frozen(cluster.procs["decode-0"].pid):
        with sdk.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        ):
            time.sleep(1.0)  # the stream's headers came; prefill answers, decode cannot
        assert _wait_aborted(cluster, aborted + 1) == aborted + 1  # the router saw the stream close
    _assert_idle(grpc_client)
    assert _aborted_count(cluster) == aborted + 1


def test_a_client_gone_mid_request_aborts_it_on_every_engine(cluster, grpc_client, long_prompt):
    aborted = _aborted_count(cluster)
    body = json.dumps({"model": MODEL, "prompt": long_prompt, "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = cluster.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    with frozen(cluster.procs["decode-0"].pid):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(1.5)  # prefill has answered; the decode stage is waiting on the frozen engine
        # the router sees the disconnect and aborts while decode is still frozen
        assert _wait_aborted(cluster, aborted + 1) == aborted + 1  # aborted, not run to its 400 tokens
    _assert_idle(grpc_client)
    assert _aborted_count(cluster) == aborted + 1


# ---------------------------------------------------------------------- curl, health, metrics


def test_curl_streams_server_sent_events(cluster):
    body = json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True, "ignore_eos": True}
    )
    out = subprocess.run(
        ["curl", "-sN", f"{cluster.http_url}/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    events = out.strip("\n").split("\n\n")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert all(event.startswith("data: ") for event in events)
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _metric(cluster, sample: str) -> float:
    base = cluster.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def test_a_streams_tokens_come_from_the_session_reader_in_the_tasks_own_chunks(
    cluster, tiny_llm, long_prompt
):
    reader = 'pdserve_router_streamed_tokens_total{path="reader"}'
    task = 'pdserve_router_streamed_tokens_total{path="task"}'
    relay = "pdserve_router_relayed_tokens_total"
    before = _metric(cluster, reader), _metric(cluster, task), _metric(cluster, relay)
    body = {
        "model": MODEL, "prompt": long_prompt, "max_tokens": 40, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}, **GREEDY,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{cluster.http_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = response.read().decode().strip("\n").split("\n\n")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    *token_chunks, usage_chunk = chunks
    expected = _reference(tiny_llm, tiny_llm.tokenizer.encode(long_prompt), 40)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == tiny_llm.tokenizer.decode(expected)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 40
    # Whoever sent it, every chunk is the one shape, of the one answer.
    for chunk in token_chunks:
        assert list(chunk) == ["id", "object", "created", "model", "choices", "usage"]
        assert (chunk["id"], chunk["created"]) == (chunks[0]["id"], chunks[0]["created"])
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL and chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
        assert choice["finish_reason"] == ("length" if chunk is token_chunks[-1] else None)
    # Most tokens went straight from the engine session's reader; a stage's first and last
    # tokens (3 here: prefill's, decode's first, the last) took the request's task.
    by_reader, by_task = _metric(cluster, reader) - before[0], _metric(cluster, task) - before[1]
    assert by_reader + by_task == 40
    assert by_reader >= 20, (by_reader, by_task)  # 37 when no engine step's message queues
    # Of those, the C token relay wrote some, where it builds: the chunks above are its too. (Not
    # most: this random model's tokens are often a character's first bytes, which Python holds.)
    if token_relay.LIBRARY.available():
        assert _metric(cluster, relay) - before[2] > 0


def test_continuous_usage_counts_every_chunks_tokens_so_far(cluster, tiny_llm, long_prompt):
    """vLLM's ``continuous_usage_stats``: each chunk's usage is the tokens streamed up to it,
    whether the session's reader or the request's task sent it."""
    body = {
        "model": MODEL, "prompt": long_prompt, "max_tokens": 24, "stream": True, "ignore_eos": True,
        "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **GREEDY,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{cluster.http_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = response.read().decode().strip("\n").split("\n\n")
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    *token_chunks, last = chunks
    ids: list[int] = []
    prompt_tokens = len(tiny_llm.tokenizer.encode(long_prompt))
    for chunk in token_chunks:
        ids += chunk["choices"][0]["token_ids"]
        assert chunk["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "total_tokens": prompt_tokens + len(ids),
        }
    assert ids == _reference(tiny_llm, tiny_llm.tokenizer.encode(long_prompt), 24)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24


def test_health_and_metrics(cluster, sdk):
    base = cluster.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/health") as response:
        assert response.status == 200
    sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    with urllib.request.urlopen(f"{base}/metrics") as response:
        text = response.read().decode()
    assert 'pdserve_router_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "pdserve_router_ttft_seconds" in text
