"""deploy/docker-compose.yml in real containers: the image built, the cluster up, what a user notices.

The image is built from deploy/Dockerfile on a local Debian base, and compose starts the file as
written (router, 2 prefill and 2 decode engines, a private network, health checks, restart
policies) through podman's Docker API. The tests run in file order against one cluster: it serves,
it is locked down, it survives a killed decode engine, and ``down`` removes it.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import LLM
from pdserve.client import Client
from pdserve.engine.request import SamplingParams

from .compose_cluster import ENGINES, PROJECT, SERVICES, ComposeCluster
from .podman_host import podman

log = logging.getLogger("containers")

TIMEOUT_S = 120.0
MAX_TOKENS = 12
# Each longer than the router's --disagg-min-tokens (32): prefill engine, KV pulled by a decode engine.
PROMPTS = [
    "Disaggregated serving runs the prompt on a prefill engine and the generation on a decode engine. "
    "The prefill engine computes the key and value cache of the prompt, and the decode engine pulls "
    "those blocks over the network before it generates the answer. In short,",
    "The history of the printing press begins in the fifteenth century, when movable metal type made "
    "books cheaper to produce than ever before. Within fifty years presses had spread across Europe, and",
    "A recipe for bread needs only flour, water, salt and yeast. Mix them, knead the dough for ten "
    "minutes, let it rise until it doubles in size, shape the loaf, and bake it in a hot oven until",
]
ENGINE_PORTS = (50051, 9400, 5600)  # gRPC, /metrics and the KV side channel, inside each engine


@pytest.fixture(scope="module")
def colocated() -> LLM:
    """The bundled model in this process, as the engines run it (--dtype auto, --quantization auto:
    the tests' own default is dense fp32, the engines' is the file's blocks in bf16 where the CPU
    has it, and in bf16 those are different numbers)."""
    return LLM(dtype="auto", quantization="auto", max_model_len=2048, num_blocks=128)


def test_every_service_becomes_healthy(cluster: ComposeCluster):
    for service in SERVICES:
        assert cluster.health(service) == "healthy", service
        assert cluster.inspect(service, "{{.State.Status}}") == "running", service
    with Client(cluster.router, api_key=cluster.api_key) as client:
        engines = client.stats(timeout=10)
    assert sorted(e["address"] for e in engines) == sorted(f"{name}:50051" for name in ENGINES)
    assert all(e["healthy"] for e in engines)


def test_greedy_tokens_through_grpc_and_http_equal_the_colocated_llm(cluster: ComposeCluster, colocated: LLM):
    # One at a time, as they are sent below: in bf16 a row's result may depend on its batch.
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [colocated.generate([prompt], params)[0] for prompt in PROMPTS]
    with Client(cluster.router, api_key=cluster.api_key) as client:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = client.generate(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=TIMEOUT_S)
            assert got.token_ids == want.token_ids, prompt
        stats = client.stats(timeout=10)
    # Sent again over HTTP, a prompt's full blocks may come from a prefill engine's prefix cache:
    # the rest of it then runs the cached-prefix attention, whose bf16 sums differ from a fresh
    # prefill's. The colocated engine, asked again, does the same from its own cache.
    again = [colocated.generate([prompt], params)[0] for prompt in PROMPTS]
    for prompt, want, cached in zip(PROMPTS, expected, again, strict=True):
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        reply = http_post(cluster, "/completions", body | {"ignore_eos": True})
        assert reply["choices"][0]["text"] in (want.text, cached.text), prompt
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    # The KV crossed container boundaries: the decode engines pulled blocks from the prefill ones.
    assert sum(e["num_blocks_pulled"] for e in stats if e["role"] == "decode") > 0
    assert sum(e["prefix_cache_queries"] for e in stats if e["role"] == "prefill") > 0


def test_the_engines_build_and_load_their_c_kernels_on_a_read_only_root(cluster: ComposeCluster):
    """The kernels' C sources ship in the image and compile into /tmp (the tmpfs) as the user."""
    probe = (
        "from pdserve.kernels.cpu import layer_ops, paged_attention, quant; "
        "print(paged_attention.KERNELS.available(), quant.available(), layer_ops.KERNELS.available())"
    )
    for service in ENGINES[:1] + ["router"]:
        checked = podman("exec", cluster.container(service), "python", "-c", probe, timeout=180)
        assert checked.stdout.split() == ["True", "True", "True"], (service, checked.stdout, checked.stderr)


def test_the_router_refuses_a_wrong_api_key(cluster: ComposeCluster):
    with Client(cluster.router, api_key="sk-wrong") as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(prompt="Hello", max_tokens=1, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(urllib.error.HTTPError) as http_refused:
        http_post(cluster, "/completions", {"prompt": "Hello", "max_tokens": 1}, api_key="sk-wrong")
    assert http_refused.value.code == 401


def test_every_process_runs_as_non_root_on_a_read_only_root_without_capabilities(cluster: ComposeCluster):
    for service in SERVICES:
        container = cluster.container(service)
        assert cluster.inspect(service, "{{.HostConfig.ReadonlyRootfs}}") == "true", service
        assert podman("exec", container, "id", "-u").stdout.strip() == "10001", service
        written = podman("exec", container, "touch", "/home/pdserve/probe", check=False)
        assert written.returncode != 0 and "Read-only file system" in written.stderr, service
        assert podman("exec", container, "touch", "/tmp/probe").returncode == 0, service  # the tmpfs
        status = podman("exec", container, "cat", "/proc/1/status").stdout
        assert "CapEff:\t0000000000000000" in status, service
        assert "NoNewPrivs:\t1" in status, service


def test_only_the_published_ports_are_reachable_from_the_host(cluster: ComposeCluster):
    # podman binds exactly the router's three published ports, on the loopback only.
    published = {}
    for service in SERVICES:
        mapping = json.loads(cluster.inspect(service, "{{json .NetworkSettings.Ports}}") or "{}")
        published[service] = {
            (binding["HostIp"], int(binding["HostPort"]))
            for bindings in mapping.values()
            for binding in bindings or ()
        }
    assert published.pop("router") == {("127.0.0.1", port) for port in cluster.ports.values()}
    assert all(not bindings for bindings in published.values()), published
    # On every address of this host, the engines' container ports answer nothing, and the router's
    # published ports answer on the loopback only.
    for address in host_addresses():
        for port in ENGINE_PORTS:
            assert not accepts(address, port), f"{address}:{port}"
        for port in cluster.ports.values():
            assert accepts(address, port) == (address == "127.0.0.1"), f"{address}:{port}"
    # The engines' network is internal: no route out of the cluster.
    outside = next((a for a in host_addresses() if a != "127.0.0.1"), "192.0.2.1")
    probe = f"import socket; s = socket.socket(); s.settimeout(5); s.connect(({outside!r}, 9))"
    for service in ENGINES:
        tried = podman("exec", cluster.container(service), "python", "-c", probe, check=False)
        assert tried.returncode != 0 and "Network is unreachable" in tried.stderr, (service, tried.stderr)


def test_a_killed_decode_engine_is_restarted_and_rejoins(cluster: ComposeCluster):
    victim = "decode-0"
    restarts_before = int(cluster.inspect(victim, "{{.RestartCount}}"))
    outcomes: dict[int, str] = {}

    def request(i: int) -> None:
        prompt = f"{PROMPTS[i % len(PROMPTS)]} (request {i})"
        try:
            with Client(cluster.router, api_key=cluster.api_key) as client:
                done = client.generate(prompt=prompt, max_tokens=32, ignore_eos=True, timeout=TIMEOUT_S)
            outcomes[i] = "ok" if len(done.token_ids) == 32 else f"short: {len(done.token_ids)}"
        except grpc.RpcError as error:
            outcomes[i] = f"{error.code().name}: {error.details()}"

    in_flight = [threading.Thread(target=request, args=(i,)) for i in range(6)]
    for thread in in_flight:
        thread.start()
    time.sleep(1.0)
    pid = int(cluster.inspect(victim, "{{.State.Pid}}"))
    subprocess.run(["kill", "-9", str(pid)], check=True)  # the engine's process, not `podman kill`
    killed_at = time.monotonic()
    after = [threading.Thread(target=request, args=(i,)) for i in range(6, 12)]
    time.sleep(0.5)
    for thread in after:
        thread.start()
    for thread in in_flight + after:
        thread.join(timeout=2 * TIMEOUT_S)
    log.info("requests around the kill: %s", outcomes)
    # Every request completes: those in flight on the killed engine are resumed on the other one.
    assert all(outcome == "ok" for outcome in outcomes.values()), outcomes
    with Client(cluster.router, api_key=cluster.api_key) as client:
        assert client.stats(timeout=10)  # the router itself is fine
    resumed = metric_value(cluster, "pdserve_router_decode_resumed_total")
    log.info("decodes resumed on another engine: %s", resumed)

    # The restart policy brings the container back, its health check passes, the router takes it back.
    deadline = time.monotonic() + 300
    while int(cluster.inspect(victim, "{{.RestartCount}}")) <= restarts_before:
        assert time.monotonic() < deadline, "not restarted"
        time.sleep(1.0)
    cluster.wait_healthy([victim], timeout_s=300)  # raises if it never becomes healthy
    log.info("%s restarted and healthy %.0f s after the kill", victim, time.monotonic() - killed_at)
    with Client(cluster.router, api_key=cluster.api_key) as client:
        for i in range(40):
            engines = {e["address"]: e for e in client.stats(timeout=10)}
            if engines[f"{victim}:50051"]["healthy"] and engines[f"{victim}:50051"]["num_blocks_pulled"] > 0:
                break
            # A prefix no engine has seen: the policy then prefers the idle, rejoined engine.
            prompt = f"After the restart, request {i}: {PROMPTS[i % len(PROMPTS)]}"
            done = client.generate(prompt=prompt, max_tokens=4, ignore_eos=True, timeout=TIMEOUT_S)
            assert len(done.token_ids) == 4
        else:
            raise AssertionError(f"{victim} never served again: {engines[f'{victim}:50051']}")


def test_compose_down_leaves_no_container_network_or_volume(cluster: ComposeCluster):
    cluster.compose("down", "--volumes", "--remove-orphans")
    label = f"label=com.docker.compose.project={PROJECT}"
    assert podman("ps", "-a", "-q", "--filter", label).stdout.split() == []
    assert podman("network", "ls", "-q", "--filter", label).stdout.split() == []
    assert podman("volume", "ls", "-q", "--filter", label).stdout.split() == []
    networks = podman("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [
        name
        for name in networks
        if name.startswith(f"{PROJECT.replace('-', '')}_") or name.startswith(PROJECT)
    ]


# ---------------------------------------------------------------------- helpers


def http_post(cluster: ComposeCluster, path: str, body: dict, api_key: str | None = None) -> dict:
    request = urllib.request.Request(
        cluster.http_base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key or cluster.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
        return json.loads(reply.read())


def metric_value(cluster: ComposeCluster, name: str) -> float:
    """A sample of the router's /metrics, through its published port."""
    url = f"http://127.0.0.1:{cluster.ports['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}")


def host_addresses() -> list[str]:
    """This host's IPv4 addresses outside the containers' bridges: the loopback and its own NICs."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    addresses = []
    for line in shown.splitlines():
        _, interface, _, cidr, *_ = line.split()
        if not interface.startswith(("podman", "veth", "cni", "docker")):
            addresses.append(cidr.split("/")[0])
    return addresses


def accepts(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(3)
        code = sock.connect_ex((address, port))
    assert code in (0, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EAGAIN), (
        address,
        port,
        code,
    )
    return code == 0
