"""Engines that come and go: ``dns:NAME:PORT`` discovery and draining on SIGTERM, end to end.

The processes run the command lines of the Kubernetes manifests (``kubectl kustomize
deploy/kubernetes``), as tests/deploy/test_compose.py does for compose: each engine pod becomes a
process on its own loopback address (127.0.0.x: the pods' container ports stay as written), the
router keeps its ``dns:pdserve-prefill:50051`` / ``dns:pdserve-decode:50051`` entries, and a real
DNS server (dnslib) on a loopback port plays the headless Services; the test changes its answers. Under a steady stream of requests the test
scales decode from 1 to 2, then rolls one decode and one prefill engine (new address in the
answer, SIGTERM to the old one, which must drain and exit 0). No client may see a failure, and
every engine must end with no KV block in use or held.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
import time

import grpc
import pytest
from dnslib.server import DNSServer

from pdserve import healthcheck
from pdserve.client import Client
from pdserve.router.discovery import EngineSource
from pdserve.supervisor import SupervisedProcess, check_health, pick_free_ports, terminate_all, wait_healthy
from pdserve.v1 import common_pb2, engine_pb2_grpc
from tests.helpers import k8s_manifests
from tests.helpers.cluster import TINY_ENGINE_ARGS
from tests.helpers.dns_zone import Zone

PREFILL, DECODE = "pdserve-prefill", "pdserve-decode"  # the headless Services' names
ENGINE_PORT = 50051  # every engine pod's gRPC port in the manifests
# A deadline, not a sleep: wait_for returns as soon as a request lands on the new engine (about
# 1 s after the DNS change: the router re-resolves every 0.5 s). The headroom is for a loaded
# machine: under xdist next to other end-to-end tests a 2-core box once took over 10 s.
JOIN_WITHIN_S = 45.0
# Requests still in flight when the last roll began may finish this long after it.
SETTLE_S = 2.0


class Processes:
    """The manifests' containers as local processes (model and sizes swapped for the tiny ones)."""

    def __init__(self, model: str, log_dir) -> None:
        self.model = model
        self.port = ENGINE_PORT
        self.log_dir = log_dir
        self.manifests = k8s_manifests.build()
        self.env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, SupervisedProcess] = {}

    def start(self, name: str, argv: list[str], address: str) -> SupervisedProcess:
        proc = SupervisedProcess(
            name,
            [sys.executable, "-m", "pdserve", *argv],
            self.log_dir / f"{name}.log",
            address=address,
            env=self.env,
        )
        proc.spawn()
        self.procs[name] = proc
        return proc

    def engine(self, role: str, ip: str) -> str:
        """A pod of the ``pdserve-ROLE`` Deployment on address ``ip``."""
        argv = k8s_manifests.container_argv(self.manifests, f"pdserve-{role}")
        argv = k8s_manifests.substitute(
            argv, {"--host": ip, "POD_IP": ip, "POD_NAME": f"pdserve-{role}-{ip}", "--num-blocks": "256"}
        )
        address = f"{ip}:{ENGINE_PORT}"
        self.start(f"{role}-{ip}", [*argv, "--model", self.model, *TINY_ENGINE_ARGS], address)
        return address

    def router(self, dns_port: int) -> str:
        """The ``pdserve-router`` Deployment's container, its ports moved to free ones."""
        port, http_port, metrics_port = pick_free_ports("127.0.0.1", 3)
        argv = k8s_manifests.container_argv(self.manifests, "pdserve-router")
        assert (
            f"--prefill=dns:{PREFILL}:{ENGINE_PORT}" in argv
            and f"--decode=dns:{DECODE}:{ENGINE_PORT}" in argv
        )
        argv = k8s_manifests.substitute(
            argv,
            {
                "--host": "127.0.0.1", "--port": str(port), "--http-port": str(http_port),
                "--metrics-port": str(metrics_port), "--discovery-interval": "0.5", "--policy": "round_robin",
            },
        )  # fmt: skip
        extra = ["--model", self.model, "--dns-server", f"127.0.0.1:{dns_port}", "--disagg-min-tokens", "0"]
        address = f"127.0.0.1:{port}"
        self.start("router", [*argv, *extra], address)
        return address

    def wait_healthy(self, *addresses: str, timeout_s: float = 120.0) -> None:
        wait_healthy([p for p in self.procs.values() if p.address in addresses], timeout_s)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}:\n{p.read_text(errors='replace')[-1500:]}" for p in self.log_dir.glob("*.log")
        )

    def stop_all(self) -> None:
        terminate_all(self.procs.values(), grace_s=30.0)


class Traffic:
    """Two clients sending requests back to back until stopped; every failure is kept."""

    def __init__(self, router: str, tokenizer) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.done: list[tuple[float, str, str]] = []  # (time, prefill engine, decode engine)
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(2)]

    def _loop(self, worker: int) -> None:
        with Client(self.router) as client:
            k = 0
            while not self.stop.is_set():
                k += 1
                prompt = self.tokenizer.encode(
                    f"Request {worker}-{k}: the river Seine flows through Paris. " * 2
                )
                try:
                    out = client.generate(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True, timeout=60)
                    assert len(out.token_ids) == 6, out
                    self.done.append(
                        (time.monotonic(), out.metrics["prefill_engine"], out.metrics["decode_engine"])
                    )
                except (grpc.RpcError, AssertionError) as exc:
                    self.failures.append(f"{worker}-{k}: {exc}")

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)

    def wait_for(self, role: str, address: str, since: float, timeout_s: float) -> float:
        """Seconds from ``since`` until a request finished on ``address``."""
        deadline = since + timeout_s
        column = 1 if role == "prefill" else 2
        while time.monotonic() < deadline:
            hits = [t for t, *engines in self.done if t >= since and engines[column - 1] == address]
            if hits:
                return hits[0] - since
            time.sleep(0.1)
        raise AssertionError(f"no request reached {role} {address} within {timeout_s:.0f}s")


def _after(traffic: Traffic, rolled: float) -> int:
    """Requests that finished once the last roll had settled (SETTLE_S after it)."""
    return sum(t > rolled + SETTLE_S for t, *_ in list(traffic.done))


def _engine_idle(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stats = engine_pb2_grpc.EngineStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
    return stats.kv_usage == 0 and stats.num_held_blocks == 0 and stats.num_running == stats.num_waiting == 0


def test_engine_sources_parse_static_and_dns_entries():
    assert EngineSource.parse("decode", "10.0.0.7:50051") == EngineSource("decode", "10.0.0.7", 50051, False)
    assert EngineSource.parse("decode", "dns:pdserve-decode:50051") == EngineSource(
        "decode", "pdserve-decode", 50051, True
    )
    assert EngineSource.parse("prefill", "[::1]:9000").static_address() == "[::1]:9000"
    for bad in ("pdserve-decode", "dns:pdserve-decode", "dns::50051", "host:0", "host:port"):
        with pytest.raises(ValueError, match="--decode entry"):
            EngineSource.parse("decode", bad)


def test_a_router_reports_not_serving_from_its_first_answer_until_a_decode_engine_is_up(
    tiny_model_dir, tmp_path
):
    """A readiness probe must never see a router that knows no engine as SERVING: grpcio's
    health servicer starts out SERVING, so the status is set before the port opens (a probe in
    the first instants used to pass, and clients got "no engine has come up yet")."""
    port, http_port, dead_port = pick_free_ports("127.0.0.1", 3)
    address = f"127.0.0.1:{port}"
    router = SupervisedProcess(
        "router",
        [
            sys.executable, "-m", "pdserve", "router", "--model", tiny_model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--http-port", str(http_port),
            "--prefill", f"127.0.0.1:{dead_port}", "--decode", f"127.0.0.1:{dead_port}",
        ],
        tmp_path / "router.log",
        address=address,
    )  # fmt: skip
    router.spawn()
    try:
        statuses: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(statuses) < 50:
            assert router.alive, router.log_tail()
            serving, status = healthcheck.check(address, timeout_s=1.0)
            assert not serving, (statuses, router.log_tail())
            if not status.startswith("UNAVAILABLE"):  # the port is open: count its answers
                statuses.append(status)
            time.sleep(0.01 if not statuses else 0.05)
        assert statuses and set(statuses) == {"NOT_SERVING"}, statuses
    finally:
        terminate_all([router], grace_s=10.0)


@pytest.mark.slow
def test_manifests_scale_and_roll_through_dns_under_load_with_no_failed_request(
    tiny_model_dir, tiny_llm, tmp_path
):
    ips = [f"127.0.0.{i}" for i in range(2, 7)]
    zone = Zone()
    zone.set(PREFILL, [ips[0]])
    zone.set(DECODE, [ips[1]])
    (dns_port,) = pick_free_ports("127.0.0.1", 1)
    dns_server = DNSServer(zone, port=dns_port, address="127.0.0.1")
    dns_server.start_thread()
    procs = Processes(tiny_model_dir, tmp_path)
    for ip in ips:
        for port in (ENGINE_PORT, 9400, 5600):  # the pods' ports, on each pod's address
            with socket.socket() as sock:
                if sock.connect_ex((ip, port)) == 0:
                    pytest.skip(f"{ip}:{port} is taken on this machine")
    try:
        prefill_old, decode_old = procs.engine("prefill", ips[0]), procs.engine("decode", ips[1])
        decode_new = procs.engine("decode", ips[2])  # up, but not in the answer yet
        # The rolls' replacements start now too, as pods a rolling update brought up early: each
        # is still healthy before it enters the answer and its predecessor gets SIGTERM, but
        # their startups overlap the others' instead of adding two in a row (~15 s each).
        decode_repl, prefill_repl = procs.engine("decode", ips[3]), procs.engine("prefill", ips[4])
        procs.wait_healthy(prefill_old, decode_old, decode_new, decode_repl, prefill_repl, timeout_s=240.0)
        router = procs.router(dns_port)
        procs.wait_healthy(router)

        with Traffic(router, tiny_llm.tokenizer) as traffic:
            traffic.wait_for("decode", decode_old, time.monotonic(), JOIN_WITHIN_S)

            # Scale decode 1 -> 2.
            scaled = time.monotonic()
            zone.set(DECODE, [ips[1], ips[2]])
            joined_s = traffic.wait_for("decode", decode_new, scaled, JOIN_WITHIN_S)

            # Roll a decode engine: its replacement enters the answer, it leaves and gets SIGTERM.
            procs.wait_healthy(decode_repl)  # up since the start: returns at once
            rolled = time.monotonic()
            zone.set(DECODE, [ips[2], ips[3]])
            procs.procs[f"decode-{ips[1]}"].send_signal(signal.SIGTERM)
            assert procs.procs[f"decode-{ips[1]}"].wait(60) == 0, procs.logs()
            traffic.wait_for("decode", decode_repl, rolled, JOIN_WITHIN_S)

            # Roll the prefill engine the same way.
            procs.wait_healthy(prefill_repl)
            rolled = time.monotonic()
            zone.set(PREFILL, [ips[4]])
            procs.procs[f"prefill-{ips[0]}"].send_signal(signal.SIGTERM)
            assert procs.procs[f"prefill-{ips[0]}"].wait(60) == 0, procs.logs()
            traffic.wait_for("prefill", prefill_repl, rolled, JOIN_WITHIN_S)
            # Traffic stays on until some requests finished well after the roll (what the check
            # below looks at) and over 20 went through in all: a deadline rather than a fixed
            # sleep, since the replacements no longer start (and keep requests flowing) in here.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                len(traffic.done) > 20 and _after(traffic, rolled) >= 4
            ):
                time.sleep(0.1)

        assert traffic.failures == [], (traffic.failures[:5], procs.logs())
        assert len(traffic.done) > 20 and _after(traffic, rolled) >= 4
        assert joined_s < JOIN_WITHIN_S
        # After the old engines left, nothing was sent to them.
        for t, prefill, decode in traffic.done:
            if t > rolled + SETTLE_S:
                assert prefill == prefill_repl and decode in (decode_new, decode_repl)
        for address in (decode_new, decode_repl, prefill_repl):
            deadline = time.monotonic() + 20
            while not _engine_idle(address) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _engine_idle(address), address
        with Client(router) as client:
            assert sorted(s["address"] for s in client.stats()) == sorted(
                [decode_new, decode_repl, prefill_repl]
            )
    finally:
        procs.stop_all()
        dns_server.stop()


def test_sigterm_drains_a_prefill_engine_until_decode_has_pulled_its_lease(tiny_model_dir, tiny_llm):
    """SIGTERM on a prefill engine holding a lease: NOT_SERVING at once, new requests refused
    with UNAVAILABLE, the process stays until decode has pulled the blocks, then exits 0; the
    request in flight completes with the colocated tokens."""
    from pdserve.cluster import LocalCluster
    from pdserve.engine.request import SamplingParams
    from pdserve.v1 import engine_pb2
    from tests.helpers.cluster import frozen, next_within

    prompt = tiny_llm.tokenizer.encode("Draining engines finish what they hold. " * 4)
    expected = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    with (
        LocalCluster(
            1, 1, model=tiny_model_dir, kv_transport="tcp", engine_args=TINY_ENGINE_ARGS,
            router_args=["--disagg-min-tokens", "0"],
        ) as cluster,
        Client(cluster.router_address) as client,
    ):  # fmt: skip
        prefill, decode = cluster.procs["prefill-0"], cluster.procs["decode-0"]
        with frozen(decode.pid):
            stream = client.stream(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True, timeout=60)
            first = next_within(stream, 30)  # from prefill: it now holds the prompt's blocks
            prefill.popen.send_signal(signal.SIGTERM)
            time.sleep(1.5)
            assert prefill.alive, "exited while decode had not pulled its lease"
            assert not check_health(prefill.address)
            with grpc.insecure_channel(prefill.address) as channel:
                refused = engine_pb2_grpc.EngineStub(channel).Generate(
                    engine_pb2.EngineGenerateRequest(request_id="late", prompt_token_ids=prompt), timeout=10
                )
                with pytest.raises(grpc.RpcError) as info:
                    list(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        tokens = list(first.token_ids) + [t for delta in stream for t in delta.token_ids]
        assert tokens == expected
        assert prefill.popen.wait(30) == 0
        assert decode.alive
