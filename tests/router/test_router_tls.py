"""TLS on the router's two front doors, with certificates made here (``tests.helpers.tls``).

A cluster whose router serves TLS with an API key and ``--protect-metrics``: the ``openai``
SDK trusting the test CA gets a completion, a plaintext client and a client trusting another CA
are refused, the gRPC client with the CA as root certificates generates, and the health check
works over TLS. A second cluster requires client certificates (mutual TLS) on both doors. Bad TLS
files stop the router at start with one line.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import httpx2
import openai
import pytest

from pdserve import healthcheck
from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.tls import ClientTls, ServerTls, TlsError
from tests.helpers.cluster import TINY_ENGINE_ARGS
from tests.helpers.tls import Pki, make_pki

MODEL = "tiny"
KEY = "sk-tls-test-key"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, pki):
    tls = ServerTls.from_options(pki.server_cert, pki.server_key)
    # Its start-up health checks trust the router's own certificate (no router_health_tls).
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, http_port=0, api_keys=[KEY], tls=tls,
        router_args=["--served-model-name", MODEL, "--protect-metrics"],
    ) as c:  # fmt: skip
        yield c


def sdk(url: str, verify: ssl.SSLContext | bool, api_key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key=api_key, max_retries=0, timeout=60, http_client=httpx2.Client(verify=verify)
    )


def test_sdk_trusting_the_ca_gets_a_completion_over_https(cluster, pki):
    assert cluster.http_url.startswith("https://")
    client = sdk(cluster.http_url, ssl.create_default_context(cafile=pki.ca))
    reply = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        sdk(cluster.http_url, ssl.create_default_context(cafile=pki.ca), "sk-wrong").models.list()


def test_plaintext_and_untrusted_clients_are_refused(cluster, pki):
    plaintext = cluster.http_url.replace("https://", "http://")
    with pytest.raises(openai.APIConnectionError):
        sdk(plaintext, False).models.list()
    with pytest.raises(openai.APIConnectionError):  # a server this CA never signed
        sdk(cluster.http_url, ssl.create_default_context(cafile=pki.other_ca)).models.list()
    with Client(cluster.router_address, api_key=KEY) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(prompt="Hello", max_tokens=2, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    untrusted = ClientTls(ca_certs=pki.other_ca)
    with Client(cluster.router_address, api_key=KEY, tls=untrusted) as client, pytest.raises(grpc.RpcError):
        client.generate(prompt="Hello", max_tokens=2, timeout=TIMEOUT_S)


def test_grpc_client_with_the_ca_as_root_certificates_generates(cluster, pki):
    with Client(cluster.router_address, api_key=KEY, tls=ClientTls(ca_certs=pki.ca)) as client:
        completion = client.generate(prompt="Hello", max_tokens=3, ignore_eos=True)
        assert len(completion.token_ids) == 3
    with Client(cluster.router_address, tls=ClientTls(ca_certs=pki.ca)) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.stats()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_healthcheck_over_tls_and_by_another_name(cluster, pki):
    port = cluster.router_address.rsplit(":", 1)[1]
    assert healthcheck.check(cluster.router_address, tls=ClientTls(ca_certs=pki.ca)) == (True, "SERVING")
    assert healthcheck.main([f"localhost:{port}", "--ssl-ca-certs", pki.ca]) == 0
    # A container checking itself dials 127.0.0.1 whatever its certificate names.
    assert (
        healthcheck.main([f"127.0.0.1:{port}", "--ssl-ca-certs", pki.ca, "--server-name", "localhost"]) == 0
    )
    assert healthcheck.main([cluster.router_address]) == 1  # plaintext


def test_protect_metrics_puts_health_and_metrics_behind_the_key(cluster, pki):
    context = ssl.create_default_context(cafile=pki.ca)
    base = cluster.http_url.removesuffix("/v1")
    metrics_port = f"http://{cluster.procs['router'].metrics_address}/metrics"
    for url, ctx in ((f"{base}/metrics", context), (f"{base}/health", context), (metrics_port, None)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=TIMEOUT_S, context=ctx)
        assert refused.value.code == 401, url
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=ctx) as reply:
            assert reply.status == 200, url


# ---------------------------------------------------------------------- mutual TLS


@pytest.fixture(scope="module")
def mtls_cluster(tiny_model_dir, pki):
    tls = ServerTls.from_options(pki.server_cert, pki.server_key, pki.ca)
    with LocalCluster(
        1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, tls=tls, http_port=0,
        router_args=["--served-model-name", MODEL],
        router_health_tls=ClientTls(pki.ca, pki.client_cert, pki.client_key),
    ) as c:  # fmt: skip
        yield c


def test_mutual_tls_on_grpc_needs_a_client_certificate(mtls_cluster, pki):
    with Client(mtls_cluster.router_address, tls=ClientTls(ca_certs=pki.ca)) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(prompt="Hello", max_tokens=2, timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(
        mtls_cluster.router_address, tls=ClientTls(pki.ca, pki.client_cert, pki.client_key)
    ) as client:
        assert len(client.generate(prompt="Hello", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_mutual_tls_on_http_needs_a_client_certificate(mtls_cluster, pki):
    with pytest.raises(openai.APIConnectionError):
        sdk(mtls_cluster.http_url, ssl.create_default_context(cafile=pki.ca)).models.list()
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(pki.client_cert, pki.client_key)
    reply = sdk(mtls_cluster.http_url, context).completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 2


# ---------------------------------------------------------------------- bad files


def test_bad_tls_files_are_one_line_errors(pki, tmp_path):
    with pytest.raises(TlsError, match="No such file"):
        ServerTls.from_options(str(tmp_path / "missing.pem"), pki.server_key)
    with pytest.raises(TlsError, match="give both"):
        ServerTls.from_options(pki.server_cert, None)
    with pytest.raises(TlsError, match="is the key the certificate's"):
        ServerTls.from_options(pki.server_cert, pki.client_key)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(TlsError, match="not a PEM file"):
        ServerTls.from_options(pki.server_cert, pki.server_key, str(not_pem))


@pytest.mark.parametrize("command", ["router", "cluster"])
def test_router_and_cluster_refuse_a_missing_certificate_at_start(tmp_path, pki, command):
    missing = tmp_path / "missing.pem"
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        command,
        "--ssl-certfile",
        str(missing),
        "--ssl-keyfile",
        pki.server_key,
    ]
    if command == "router":
        argv += ["--port", "1", "--decode", "127.0.0.1:2"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --ssl-certfile {missing}: No such file or directory"
