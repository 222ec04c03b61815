"""Overload: 500 requests arriving (Poisson) at twice what the cluster can serve.

The router's bound (``--max-inflight``) turns the excess into RESOURCE_EXHAUSTED at once
instead of a queue that grows without limit: every request either completes or is refused
with that status, nothing else; no KV block is left behind; the router's memory stays flat.
The rate is set from a capacity measured in the same run, never from a constant.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc
import pytest

from pdserve.client import Client
from pdserve.v1 import router_pb2_grpc
from tests.helpers.reliability import CALL_TIMEOUT_S, generate_request, rss_mb, settle, wait_idle
from tests.helpers.text_corpus import long_text

MAX_INFLIGHT = 8
NUM_REQUESTS = 500
MAX_TOKENS = 4
CAPACITY_PROBE = 48  # requests, run MAX_INFLIGHT at a time, to measure what the cluster serves
OVERLOAD = 2.0
MAX_RSS_GROWTH_MB = 50.0


@dataclass
class Outcome:
    code: grpc.StatusCode
    finish_reason: str = ""
    num_tokens: int = 0
    details: str = ""


@pytest.fixture(scope="module")
def overload(cluster, shared):
    router = cluster.router(
        "overload-router", [shared.prefill], [shared.decode], args=["--max-inflight", str(MAX_INFLIGHT)]
    )
    router.wait_serving()
    with Client(router.address) as client:
        settle(client, [shared.prefill, shared.decode])
        yield router, client


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Real-text prompts of 8 to 120 tokens (about half short enough to skip prefill)."""
    rng = random.Random(seed)
    text = tokenizer.encode(long_text(20_000))
    prompts = []
    for _ in range(count):
        length = rng.randint(8, 120)
        start = rng.randrange(len(text) - length)
        prompts.append(text[start : start + length])
    return prompts


async def _one(stub: router_pb2_grpc.RouterStub, prompt: list[int]) -> Outcome:
    call = stub.Generate(generate_request(prompt, MAX_TOKENS), timeout=CALL_TIMEOUT_S)
    outcome = Outcome(grpc.StatusCode.OK)
    try:
        async for message in call:
            outcome.num_tokens += len(message.token_ids)
            outcome.finish_reason = message.finish_reason or outcome.finish_reason
    except grpc.aio.AioRpcError as exc:
        return Outcome(exc.code(), details=exc.details() or "")
    return outcome


async def _capacity(address: str, prompts: list[list[int]]) -> float:
    """Requests per second served with MAX_INFLIGHT of them in flight at all times."""
    todo = list(prompts)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def worker() -> None:
            while todo:
                outcome = await _one(stub, todo.pop())
                assert outcome.code == grpc.StatusCode.OK, outcome

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(MAX_INFLIGHT)))
        return len(prompts) / (time.perf_counter() - start)


async def _poisson(address: str, prompts: list[list[int]], rate: float, router_pid: int) -> tuple[list, list]:
    """Send every prompt at Poisson arrivals of ``rate``/s; outcomes, and the router's RSS
    once the first 100 requests have ended and after the last one."""
    rng = random.Random(1)
    rss: list[float] = []
    ended = 0

    async def tracked(stub, prompt) -> Outcome:
        nonlocal ended
        try:
            return await _one(stub, prompt)
        finally:
            ended += 1
            if ended == 100:
                rss.append(rss_mb(router_pid))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(tracked(stub, prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
    rss.append(rss_mb(router_pid))
    return outcomes, rss


def test_overload_each_request_completes_or_is_refused_and_nothing_leaks(overload, shared, tokenizer):
    router, client = overload
    capacity = asyncio.run(_capacity(router.address, _prompts(tokenizer, CAPACITY_PROBE, seed=0)))
    rate = OVERLOAD * capacity
    outcomes, rss = asyncio.run(
        _poisson(router.address, _prompts(tokenizer, NUM_REQUESTS, seed=2), rate, router.pid)
    )

    completed = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    others = [o for o in outcomes if o.code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)]
    summary = f"{capacity:.1f} req/s capacity, {rate:.1f} req/s offered: {len(completed)} done, {len(refused)} refused"
    print(f"{summary}; router RSS {rss[0]:.0f} -> {rss[1]:.0f} MB")
    assert others == [], f"{summary}; other outcomes: {others[:5]}"
    assert all(o.finish_reason in ("length", "stop") and o.num_tokens >= 1 for o in completed), summary
    assert all("retry later" in o.details for o in refused), refused[:3]
    assert refused, f"{summary}: the router never had to refuse"
    assert len(completed) >= NUM_REQUESTS // 10, f"{summary}: the router hardly served anything"
    wait_idle([shared.prefill, shared.decode])
    assert rss[1] - rss[0] < MAX_RSS_GROWTH_MB, f"router RSS grew from {rss[0]:.0f} MB to {rss[1]:.0f} MB"
    # Still serving normally once the burst is over.
    assert client.generate(
        prompt="After the storm", max_tokens=MAX_TOKENS, timeout=CALL_TIMEOUT_S
    ).finish_reason
