"""Fuzzing the OpenAI HTTP API with arbitrary JSON bodies: every answer is a 200 or a 4xx in
OpenAI's error shape, never a 5xx and never a hang, and the cluster is leak-free afterwards.

Bodies mix valid fields with wrong types, out-of-range and huge numbers, unknown keys, nested
junk, bad roles, token ids outside the vocabulary and empty or long prompts; a few raw-byte
cases cover what JSON cannot (not JSON, not an object, wrong content type, too large).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.client import Client
from pdserve.cluster import LocalCluster
from tests.helpers.cluster import TINY_ENGINE_ARGS, is_idle, wait_idle

MODEL = "tiny"
TIMEOUT_S = 30.0

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
# A valid body (every field optional, values in range), then up to two fields replaced by
# anything at all: about half the bodies are served, the rest must be refused cleanly.
valid_ids = st.lists(st.integers(3, 280), min_size=1, max_size=40)
valid_sampling = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 2),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 280), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.none(),
    "user": st.text(max_size=5),
}
valid_prompt = st.text(min_size=1, max_size=60) | st.lists(
    st.text(min_size=1, max_size=20), min_size=1, max_size=3
)
valid_prompt = valid_prompt | valid_ids | st.lists(valid_ids, min_size=1, max_size=2)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(min_size=1, max_size=40)}
)
anything = (
    junk
    | st.integers(-3, 40)
    | st.floats()
    | st.text(max_size=3)
    | st.lists(st.integers(-5, 400), max_size=5)
)
bad_field = st.sampled_from([*valid_sampling, "prompt", "messages", "logprobs", "echo", "tools", "surprise"])


def fuzzed(required: dict) -> st.SearchStrategy[dict]:
    body = st.fixed_dictionaries(required, optional=valid_sampling)
    return st.tuples(body, st.dictionaries(bad_field, anything, max_size=2)).map(
        lambda pair: {**pair[0], **pair[1]}
    )


completion_body = fuzzed({"prompt": valid_prompt})
chat_body = fuzzed({"messages": st.lists(message, min_size=1, max_size=3)})


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS,
        router_args=["--served-model-name", MODEL, "--max-request-body-bytes", "65536"], http_port=0,
    ) as c:  # fmt: skip
        yield c


def post(cluster, path: str, data: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"{cluster.http_url}{path}", data=data, method="POST", headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def assert_ok_or_client_error(status: int, body: bytes, sent: object) -> None:
    assert status == 200 or 400 <= status < 500, (status, body[:300], sent)
    if status != 200:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
    elif body.startswith(b"data: "):  # a stream: SSE events, ending with [DONE] (or an error event)
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]


FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


@FUZZ
@given(body=completion_body)
def test_fuzzed_completion_bodies_get_200_or_4xx(cluster, body):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep generation short; validation still sees every other value
    status, reply = post(cluster, "/completions", json.dumps(body).encode())
    assert_ok_or_client_error(status, reply, body)


@FUZZ
@given(body=chat_body)
def test_fuzzed_chat_bodies_get_200_or_4xx(cluster, body):
    body.setdefault("max_tokens", 4)
    status, reply = post(cluster, "/chat/completions", json.dumps(body).encode())
    assert_ok_or_client_error(status, reply, body)


@pytest.mark.parametrize(
    ("data", "content_type", "expected"),
    [
        (b"not json at all", "application/json", 400),
        (b"[1, 2, 3]", "application/json", 400),
        (b'{"prompt": "hi"', "application/json", 400),
        (b'{"prompt": "hi", "max_tokens": 1e999}', "application/json", 400),
        (b'{"prompt": "hi", "temperature": NaN}', "application/json", 400),
        (b'{"prompt": "hi"}', "text/plain", 415),
        (b"\xff\xfe\x00garbage", "application/json", 400),
        (b'{"prompt": "' + b"a" * 70_000 + b'"}', "application/json", 413),
    ],
)
def test_raw_bodies_json_cannot_express_get_4xx(cluster, data, content_type, expected):
    status, reply = post(cluster, "/completions", data, content_type)
    assert status == expected, reply[:300]
    assert set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}


def test_cluster_is_leak_free_and_serving_after_the_fuzz(cluster):
    with Client(cluster.router_address) as client:
        stats = wait_idle(client)
        assert all(is_idle(s) for s in stats), stats
    status, reply = post(cluster, "/completions", json.dumps({"prompt": "Hello", "max_tokens": 3}).encode())
    assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 3
