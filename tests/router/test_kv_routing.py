"""KV-cache events end to end: engines publish, the router indexes them and routes on them.

Real processes on the tiny model (``LocalCluster`` with ``kv_events=True``): one prefill and
two decode engines, with caches small enough to evict, and the PUB socket of every engine
told to lose its batch 3 on purpose. What a user notices: the router's expected prefix hits
(in each request's metrics) equal what the engines report they hit; an evicted or restarted
engine's blocks are no longer expected; the lost message is replayed, not missed.
"""

from __future__ import annotations

import random
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.engine.kv_cache import hash_request_blocks
from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from pdserve.supervisor import wait_healthy
from tests.helpers.kv_events import engine_stream

pytestmark = pytest.mark.slow

BLOCK = 16
ENGINE_ARGS = ["--max-model-len", "512", "--num-blocks", "40", "--max-num-batched-tokens", "512"]
LOST_SEQ = 3
WAIT_S = 30.0  # a bound for the router to see an engine change; reaching it is a failure


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with LocalCluster(
        1,
        2,
        model=tiny_model_dir,
        kv_events=True,
        policy="kv",
        engine_args=ENGINE_ARGS,
        router_args=["--disagg-min-tokens", "0"],
        env={"PDSERVE_KV_EVENTS_DROP_SEQS": str(LOST_SEQ)},
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def _router_metrics(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _metric(where, name: str, engine: str) -> float:
    """A per-engine router metric; ``where`` is a LocalCluster or the router's metrics address."""
    address = where if isinstance(where, str) else where.procs["router"].metrics_address
    return _router_metrics(address).get((name, (("engine", engine),)), 0.0)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _held(events: list) -> set[int]:
    held: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            held.clear()
    return held


def _generate(client: Client, tokens: list[int]) -> dict:
    completion = client.generate(prompt_token_ids=tokens, max_tokens=3, ignore_eos=True, timeout=60)
    time.sleep(0.3)  # let the engines' events of this request reach the router before the next
    return completion.metrics


def test_router_expects_exactly_the_prefix_hits_engines_report_in_a_steady_workload(cluster, client):
    tenants = [_tokens(1000 + t, 80) for t in range(3)]  # 5 blocks of system prompt each
    misses = []
    for i in range(12):
        prompt = tenants[i % 3] + _tokens(i, 20 + i)
        m = _generate(client, prompt)
        for role in ("prefill", "decode"):
            if m[f"expected_{role}_hit_blocks"] != m[f"{role}_hit_blocks"]:
                misses.append((i, role, m[f"expected_{role}_hit_blocks"], m[f"{role}_hit_blocks"]))
        if i >= 3:  # its tenant's system prompt was seen: prefill hits it
            assert m["prefill_hit_blocks"] >= 5, m
    assert not misses, f"router expectation != engine hit (request, role, expected, hit): {misses}"


def test_concurrent_requests_of_a_new_prefix_go_to_the_decode_engine_the_first_went_to(cluster, client):
    """The second request's decode is routed while the first's blocks are, at best, being
    pulled: no engine's BlockStored says it holds them yet, but the router counts them as
    pending on the first one's engine (6 blocks - 4 x 1 in flight > 0 elsewhere)."""
    prefix = _tokens(11, 100)
    prompts = [prefix + _tokens(200 + i, 20) for i in range(2)]

    def generate(prompt: list[int]) -> dict:
        return client.generate(prompt_token_ids=prompt, max_tokens=3, ignore_eos=True, timeout=60).metrics

    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(generate, prompts)
    assert first["decode_engine"] == second["decode_engine"], (first, second)


def test_a_pub_message_lost_on_purpose_is_replayed_and_the_index_stays_exact(cluster, client):
    prefill = cluster.prefill_addresses[0]
    _wait_for(lambda: _metric(cluster, "pdserve_router_kv_replays_total", prefill) >= 1, "a replay")
    assert _metric(cluster, "pdserve_router_kv_resyncs_total", prefill) == 0
    for engine in cluster.prefill_addresses + cluster.decode_addresses:
        truth = len(_held(engine_stream(engine)))
        _wait_for(
            lambda engine=engine, truth=truth: (
                _metric(cluster, "pdserve_router_kv_index_blocks", engine) == truth
            ),
            f"the router's index of {engine} to hold its {truth} blocks",
        )


def test_an_evicted_block_leaves_the_index(cluster, client):
    prompt = _tokens(7, 100)
    first_block = hash_request_blocks(prompt, BLOCK, [])[0].hash_value
    _generate(client, prompt)
    assert _generate(client, prompt)["expected_prefill_hit_blocks"] == 6  # cached, and known
    prefill = cluster.prefill_addresses[0]
    for i in range(6):  # 6 x 7 blocks through a 40-block cache: the prompt's blocks are reused
        _generate(client, _tokens(100 + i, 110))
    assert first_block not in _held(engine_stream(prefill))
    m = _generate(client, prompt)
    assert m["expected_prefill_hit_blocks"] == m["prefill_hit_blocks"] == 0, m


def test_a_killed_and_restarted_engine_loses_its_entries(cluster, client):
    prompt = _tokens(8, 100)
    _generate(client, prompt)
    assert _generate(client, prompt)["expected_prefill_hit_blocks"] == 6
    proc = cluster.procs["prefill-0"]
    prefill = proc.address
    assert _metric(cluster, "pdserve_router_kv_index_blocks", prefill) > 0
    proc.signal_group(signal.SIGKILL)
    proc.wait(timeout=30)
    _wait_for(lambda: _metric(cluster, "pdserve_router_kv_index_blocks", prefill) == 0, "its entries to go")
    proc.spawn()
    wait_healthy([proc], timeout_s=120)
    _wait_for(lambda: _metric(cluster, "pdserve_router_kv_in_sync", prefill) == 1, "its new stream in sync")
    m = _generate(client, prompt)
    assert m["expected_prefill_hit_blocks"] == m["prefill_hit_blocks"] == 0, m
    assert _generate(client, prompt)["expected_prefill_hit_blocks"] == 6


def test_an_engine_found_through_dns_is_followed_and_loses_its_entries_when_it_leaves(
    tiny_model_dir, tmp_path
):
    """``--decode dns:NAME:PORT``: the engine the name resolves to is subscribed to; once the
    name no longer lists it, it leaves the pool and its entries leave the index."""
    from dnslib.server import DNSServer

    from pdserve.supervisor import SupervisedProcess, pick_free_ports, terminate_all
    from tests.helpers.dns_zone import Zone

    zone = Zone()
    dns_port, engine_port, router_port, metrics_port = pick_free_ports("127.0.0.1", 4)
    dns = DNSServer(zone, port=dns_port, address="127.0.0.1")
    dns.start_thread()
    engine = f"127.0.0.1:{engine_port}"
    procs = [
        SupervisedProcess(
            "decode",
            ["-m", "pdserve", "decode", "--port", str(engine_port), "--model", tiny_model_dir,
             "--kv-events-port", "0", *ENGINE_ARGS],
            tmp_path / "decode.log",
            address=engine,
        ),
        SupervisedProcess(
            "router",
            ["-m", "pdserve", "router", "--port", str(router_port), "--metrics-port", str(metrics_port),
             "--decode", f"dns:pdserve-decode:{engine_port}", "--dns-server", f"127.0.0.1:{dns_port}",
             "--discovery-interval", "0.5", "--model", tiny_model_dir],
            tmp_path / "router.log",
            address=f"127.0.0.1:{router_port}",
        ),
    ]  # fmt: skip
    for proc in procs:
        proc.argv.insert(0, sys.executable)
    zone.set("pdserve-decode", ["127.0.0.1"])
    try:
        for proc in procs:
            proc.spawn()
        wait_healthy(procs, timeout_s=120)
        router_metrics = f"127.0.0.1:{metrics_port}"
        _wait_for(
            lambda: _metric(router_metrics, "pdserve_router_kv_in_sync", engine) == 1,
            "the dns: engine in sync",
        )
        prompt = _tokens(9, 100)
        with Client(f"127.0.0.1:{router_port}") as client:
            _generate(client, prompt)
            m = _generate(client, prompt)
        assert m["expected_decode_hit_blocks"] == m["decode_hit_blocks"] == 6, m
        assert _metric(router_metrics, "pdserve_router_kv_index_blocks", engine) >= 6
        zone.set("pdserve-decode", [])
        _wait_for(
            lambda: _metric(router_metrics, "pdserve_router_kv_index_blocks", engine) == 0,
            "its entries to go",
        )
        assert _metric(router_metrics, "pdserve_router_kv_in_sync", engine) == 0
    finally:
        terminate_all(procs, grace_s=10.0)
        dns.stop()
