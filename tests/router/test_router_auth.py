"""API keys on the router's two front doors, as a client sees them.

One 1P1D cluster on the tiny model, started with two keys (one given to the cluster, one
through the router's environment), serves the end-to-end tests: the ``openai`` SDK gets
``AuthenticationError`` without the right key and completions with it; gRPC gets
UNAUTHENTICATED without it; probes and Prometheus still get through; and a fuzz of the
``Authorization`` header never gets a 5xx or a hang.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve import healthcheck
from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.router.auth import ApiKeys, bearer_key, client_metadata, load_api_keys
from tests.helpers.cluster import TINY_ENGINE_ARGS

MODEL = "tiny"
KEY = "sk-pdserve-test-0123456789abcdef"
ENV_KEY = "sk-from-the-environment"
TIMEOUT_S = 30.0

# ---------------------------------------------------------------------- keys, without a server


def test_a_key_is_accepted_only_when_equal_to_one_configured():
    keys = ApiKeys(["alpha", "beta-longer-key"])
    assert keys.accepts("alpha") and keys.accepts("beta-longer-key")
    for wrong in ("", "alph", "alphaa", "ALPHA", "beta", None):
        assert not keys.accepts(wrong)
    assert not ApiKeys() and ApiKeys().check_authorization(None) is None  # no keys: open


def test_bearer_scheme_is_case_insensitive_and_the_key_is_not():
    assert bearer_key("Bearer k") == bearer_key("bearer k") == bearer_key("  BEARER   k ") == "k"
    for header in (None, "", "Bearer", "Bearer ", "Basic k", "k", "Token k"):
        assert bearer_key(header) is None
    keys = ApiKeys(["k"])
    assert keys.check_authorization("Bearer k") is None
    assert "missing" in keys.check_authorization("Basic k")
    assert keys.check_authorization("Bearer K") == "invalid API key"


def test_keys_come_from_flags_environment_and_a_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key a line\nfile-key-1\n\n  file-key-2  \n")
    keys = load_api_keys(["flag-key"], str(key_file), {"PDSERVE_API_KEYS": "env-1, env-2,"})
    assert len(keys) == 5
    for key in ("flag-key", "env-1", "env-2", "file-key-1", "file-key-2"):
        assert keys.accepts(key), key
    from_env_file = load_api_keys(None, None, {"PDSERVE_API_KEYS_FILE": str(key_file)})
    assert from_env_file.accepts("file-key-2") and len(from_env_file) == 2


def test_bad_keys_are_refused_without_showing_them(tmp_path):
    secret = "sk-secret with space"
    with pytest.raises(ValueError, match="space") as refused:
        load_api_keys([secret], None, {})
    assert "secret" not in str(refused.value)
    bad_file = tmp_path / "keys"
    bad_file.write_text("good\nsk-secret\tbad\n")
    with pytest.raises(ValueError, match="line 2") as refused:
        load_api_keys(None, str(bad_file), {})
    assert "sk-secret" not in str(refused.value)
    with pytest.raises(ValueError, match="No such file"):
        load_api_keys(None, str(tmp_path / "missing"), {})


def test_clients_send_the_given_key_else_one_from_the_environment():
    assert client_metadata("k1", {}) == (("authorization", "Bearer k1"),)
    assert client_metadata(None, {"PDSERVE_API_KEY": "k2", "PDSERVE_API_KEYS": "k3"}) == (
        ("authorization", "Bearer k2"),
    )
    assert client_metadata(None, {"PDSERVE_API_KEYS": " k3 ,k4"}) == (("authorization", "Bearer k3"),)
    assert client_metadata(None, {}) == ()
    with pytest.raises(ValueError, match="space"):
        client_metadata("two words", {})


def test_router_refuses_to_start_on_a_missing_key_file_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "router", "--port", "1", "--decode", "127.0.0.1:2",
         "--api-key-file", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: API key file {tmp_path / 'missing'}: No such file or directory"


# ---------------------------------------------------------------------- a cluster with keys


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, http_port=0, api_keys=[KEY],
        router_args=["--served-model-name", MODEL], env={"PDSERVE_API_KEYS": ENV_KEY},
    ) as c:  # fmt: skip
        yield c


def sdk(cluster, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url, api_key=api_key, max_retries=0, timeout=60)


def test_sdk_without_the_right_key_gets_authentication_error(cluster):
    missing = {"Authorization": openai.omit}  # the SDK sends no Authorization header at all
    cases = [(sdk(cluster, wrong), {}) for wrong in ("sk-wrong", KEY[:-1], KEY + "x", KEY.upper())]
    for client, headers in [*cases, (sdk(cluster, KEY), missing)]:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_headers=headers)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
        assert KEY not in str(refused.value)
        with pytest.raises(openai.AuthenticationError):
            client.models.list(extra_headers=headers)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_headers=headers
            )


def test_sdk_with_either_key_gets_completions(cluster):
    for key in (KEY, ENV_KEY):
        client = sdk(cluster, key)
        reply = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 3
        (model,) = client.models.list().data
        assert model.id == MODEL
    with sdk(cluster, KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:  # fmt: skip
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1


def test_grpc_without_the_right_key_is_unauthenticated(cluster):
    for wrong in (None, "sk-wrong"):
        with Client(cluster.router_address, api_key=wrong) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(prompt="Hello", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused:
                client.stats()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused:
                client.abort("no-such-request")
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_the_key_generates_and_env_key_is_the_default(cluster, monkeypatch):
    with Client(cluster.router_address, api_key=KEY) as client:
        completion = client.generate(prompt="Hello", max_tokens=3, ignore_eos=True)
        assert len(completion.token_ids) == 3
        assert {e["role"] for e in client.stats()} == {"prefill", "decode"}
    monkeypatch.setenv("PDSERVE_API_KEY", ENV_KEY)
    with Client(cluster.router_address) as client:
        assert client.abort("no-such-request") is False


def test_pdserve_generate_sends_the_key(cluster):
    base = [sys.executable, "-m", "pdserve", "generate", "Hello", "--router", cluster.router_address,
            "--max-tokens", "2"]  # fmt: skip
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    served = subprocess.run([*base, "--api-key", KEY], capture_output=True, text=True, timeout=120)
    assert served.returncode == 0, served.stderr
    assert KEY not in served.stdout + served.stderr


def test_health_and_metrics_stay_open_for_probes_and_prometheus(cluster):
    base = cluster.http_url.removesuffix("/v1")
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(f"{base}{path}", timeout=TIMEOUT_S) as reply:
            assert reply.status == 200
    with urllib.request.urlopen(f"http://{cluster.procs['router'].metrics_address}/metrics") as reply:
        assert reply.status == 200 and b"pdserve_router_http_requests_total" in reply.read()
    assert healthcheck.check(cluster.router_address) == (True, "SERVING")


def test_refusals_are_counted_and_no_key_reaches_the_logs(cluster):
    base = cluster.http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=TIMEOUT_S) as reply:
        metrics = reply.read().decode()
    assert 'pdserve_router_http_requests_total{endpoint="/v1/completions",status="401"}' in metrics
    with open(cluster.procs["router"].log_path) as log:
        text = log.read()
    assert KEY not in text and ENV_KEY not in text
    assert KEY not in " ".join(cluster.procs["router"].argv)  # given through the environment


# ---------------------------------------------------------------------- fuzzing the header

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
header_bytes = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
near_key = st.sampled_from([KEY, ENV_KEY, KEY[:-1], KEY + "\x00", KEY.upper(), "", " ", KEY + " " + KEY])
header = st.one_of(
    header_bytes,
    st.tuples(
        st.sampled_from(["Bearer", "bearer", "BEARER", "Basic", "Bearer:", ""]), st.text(max_size=3), near_key
    ).map(lambda parts: f"{parts[0]}{parts[1]}{parts[2]}".encode("utf-8", "surrogatepass")),
    st.tuples(st.sampled_from(["Bearer ", "bearer "]), near_key, st.text(max_size=4)).map(
        lambda parts: "".join(parts).encode("utf-8", "surrogatepass")
    ),
)


def raw_request(cluster, method: str, path: str, headers: list[bytes], body: bytes = b"") -> int:
    """The status code of one request sent byte for byte (no client library cleans the header)."""
    host, port = cluster.http_url.split("//")[1].split("/")[0].split(":")
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: {host}".encode(), *headers,
             b"Connection: close", f"Content-Length: {len(body)}".encode()]  # fmt: skip
    if body:
        lines.append(b"Content-Type: application/json")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)  # a hang raises socket.timeout
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@FUZZ
@given(value=header, path=st.sampled_from(["/v1/models", "/v1/completions", "/v1/nowhere"]))
def test_fuzzed_authorization_header_never_gets_a_5xx_or_hangs(cluster, value, path):
    method, body = (
        ("POST", b'{"prompt": "Hi", "max_tokens": 1}') if path == "/v1/completions" else ("GET", b"")
    )
    status = raw_request(cluster, method, path, [b"Authorization: " + value], body)
    assert status < 500, (status, value)
    key = bearer_key(value.decode("latin-1"))
    if status < 400:
        assert key in (KEY, ENV_KEY), value
    elif key not in (KEY, ENV_KEY):
        assert status in (400, 401), (status, value)  # 400: a header the HTTP parser refuses


def test_two_authorization_headers_and_none_at_all(cluster):
    good, bad = f"Authorization: Bearer {KEY}".encode(), b"Authorization: Bearer nope"
    assert raw_request(cluster, "GET", "/v1/models", []) == 401
    assert raw_request(cluster, "GET", "/v1/models", [good]) == 200
    assert raw_request(cluster, "GET", "/v1/models", [good, bad]) in (200, 400, 401)
    assert raw_request(cluster, "GET", "/health", [bad]) == 200
    reply = urllib.request.Request(f"{cluster.http_url}/models", headers={"Authorization": "Bearer nope"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(reply, timeout=TIMEOUT_S)
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
    error = json.loads(refused.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] == "invalid API key"
