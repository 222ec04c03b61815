"""Conditional disaggregation by load (``--max-prefill-queue``): while every prefill engine has
that many prompts in its prefill stage, a decode engine that is prefilling nothing itself takes
the next prompt whole, and the answer is the one the disaggregated path gives.

Real processes (``LocalCluster``, the tiny model). The prefill engine is stopped (SIGSTOP) so
that its queue is known, not raced: one prompt sits in it, the next goes to decode; a prompt
longer than ``--max-local-prefill-tokens`` waits for the prefill engine all the same, and so
does a short one that would take a decode engine's prompts in prefill past
``--max-local-prefill-queue-tokens``.
"""

from __future__ import annotations

import functools
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.engine.request import SamplingParams
from tests.helpers.cluster import TINY_ENGINE_ARGS, frozen, is_idle, wait_idle
from tests.helpers.text_corpus import long_text, prompts_of_lengths

MAX_TOKENS = 8
MAX_LOCAL_PREFILL_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    router_args = ["--max-prefill-queue", "1", "--max-local-prefill-tokens", str(MAX_LOCAL_PREFILL_TOKENS)]
    with LocalCluster(1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, router_args=router_args) as c:
        yield c


def _routed(cluster: LocalCluster) -> dict[str, float]:
    """The router's ``pdserve_router_routed_total`` by path."""
    with urllib.request.urlopen(
        f"http://{cluster.procs['router'].metrics_address}/metrics", timeout=10
    ) as reply:
        text = reply.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_routed_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            counts[path] = float(line.rsplit(" ", 1)[1])
    return counts


def _reference(llm, prompts: list[list[int]]) -> list[list[int]]:
    """The tokens the in-process engine gives each prompt."""
    return [
        c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]


def _generate(client: Client, prompt: list[int]):
    return client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60.0)


def test_a_backlogged_prefill_engine_hands_the_next_prompt_to_decode(cluster, tiny_llm):
    first, second, too_long = prompts_of_lengths(
        tiny_llm.tokenizer, [120, 130, MAX_LOCAL_PREFILL_TOKENS + 50]
    )
    expected = _reference(tiny_llm, [first, second, too_long])
    before = _routed(cluster)
    with Client(cluster.router_address) as client, ThreadPoolExecutor(3) as pool:
        generate = functools.partial(_generate, client)

        with frozen(cluster.procs["prefill-0"].pid):
            queued = pool.submit(generate, first)  # the prefill engine's one prompt: it cannot answer
            time.sleep(1.0)  # the router has sent it (the engine is stopped: nothing to poll)
            handed = pool.submit(generate, second).result(timeout=60.0)  # done while prefill is stopped
            waiting = pool.submit(generate, too_long)  # too long for decode: waits for prefill
            time.sleep(0.5)
            assert not waiting.done()
        completions = [queued.result(timeout=60.0), handed, waiting.result(timeout=60.0)]
        assert [c.token_ids for c in completions] == expected
        assert completions[0].metrics["prefill_engine"] == cluster.prefill_addresses[0]
        assert completions[1].metrics["prefill_engine"] == ""  # prefilled on decode
        assert completions[1].metrics["decode_engine"] == cluster.decode_addresses[0]
        assert completions[2].metrics["prefill_engine"] == cluster.prefill_addresses[0]
        stats = wait_idle(client)
        assert stats and all(is_idle(s) for s in stats), stats
    after = _routed(cluster)
    assert after.get("backlog_colocated", 0) - before.get("backlog_colocated", 0) == 1
    assert after.get("disaggregated", 0) - before.get("disaggregated", 0) == 2


def test_a_decode_engine_takes_short_prompts_whole_within_its_token_budget(cluster, tiny_llm):
    """Two 60-token prompts are prefilled on the decode engine at once (120 tokens, within the
    default budget of 128), a third waits for the prefill engine: the decode engine is stopped
    too, so all three arrive while it is still prefilling."""
    prompts = [
        tiny_llm.tokenizer.encode(f"Note {k}: " + long_text(900, start=20 + k))[:n]
        for k, n in enumerate((150, 60, 60, 60))
    ]
    expected = _reference(tiny_llm, prompts)
    before = _routed(cluster)
    with Client(cluster.router_address) as client, ThreadPoolExecutor(4) as pool:
        generate = functools.partial(_generate, client)

        with frozen(cluster.procs["prefill-0"].pid):
            queued = pool.submit(generate, prompts[0])  # the prefill engine's one prompt
            time.sleep(1.0)
            with frozen(cluster.procs["decode-0"].pid):
                handed = [pool.submit(generate, prompt) for prompt in prompts[1:3]]
                time.sleep(0.5)  # both sent to decode, which cannot answer yet
                waiting = pool.submit(generate, prompts[3])
                time.sleep(0.5)
            done = [future.result(timeout=60.0) for future in handed]  # while prefill is stopped
            assert not waiting.done()
        completions = [queued.result(timeout=60.0), *done, waiting.result(timeout=60.0)]
        assert [c.token_ids for c in completions] == expected
        prefill_engines = [c.metrics["prefill_engine"] for c in completions]
        assert prefill_engines == [cluster.prefill_addresses[0], "", "", cluster.prefill_addresses[0]]
        stats = wait_idle(client)
        assert stats and all(is_idle(s) for s in stats), stats
    after = _routed(cluster)
    assert after.get("backlog_colocated", 0) - before.get("backlog_colocated", 0) == 2
    assert after.get("disaggregated", 0) - before.get("disaggregated", 0) == 2


def test_without_a_backlog_prompts_go_through_prefill(cluster, tiny_llm):
    # Unlike prompts_of_lengths' (the other test's), no prefix any engine has cached: a cached
    # one would be short enough to go to decode anyway.
    prompts = [tiny_llm.tokenizer.encode(f"Part {k}: " + long_text(900, start=7 + k))[:150] for k in range(3)]
    with Client(cluster.router_address) as client:
        for prompt in prompts:  # one at a time: the prefill engine's queue is never 1 on arrival
            completion = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert completion.metrics["prefill_engine"] == cluster.prefill_addresses[0]


def test_one_long_prompt_in_prefill_hands_a_short_one_to_decode(tiny_model_dir, tiny_llm):
    """``--max-prefill-queue-tokens``: one prompt of more tokens than that in the prefill stage
    is a backlog too (a short prompt would wait for all of it), while the same prompt count of
    short prompts is not."""
    router_args = ["--max-prefill-queue", "3", "--max-prefill-queue-tokens", "200"]
    prompts = [
        tiny_llm.tokenizer.encode(f"Item {k}: " + long_text(2000, start=40 + k))[:n]
        for k, n in enumerate((260, 60, 70, 50))
    ]
    expected = _reference(tiny_llm, prompts)
    with (
        LocalCluster(
            1, 1, model=tiny_model_dir, engine_args=TINY_ENGINE_ARGS, router_args=router_args
        ) as cluster,
        Client(cluster.router_address) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        generate = functools.partial(_generate, client)

        completions = []
        with frozen(cluster.procs["prefill-0"].pid):
            queued = pool.submit(generate, prompts[0])  # 260 uncached tokens in the prefill stage
            time.sleep(1.0)
            completions.append(
                pool.submit(generate, prompts[1]).result(timeout=60.0)
            )  # while prefill is stopped
        completions.insert(0, queued.result(timeout=60.0))
        # With a 70-token prompt ahead, below 200 tokens and 3 prompts: the next one waits for prefill.
        with frozen(cluster.procs["prefill-0"].pid):
            queued = pool.submit(generate, prompts[2])
            time.sleep(1.0)
            waiting = pool.submit(generate, prompts[3])
            time.sleep(0.5)
            assert not waiting.done()
        completions += [queued.result(timeout=60.0), waiting.result(timeout=60.0)]
        assert [c.token_ids for c in completions] == expected
        prefill_engines = [c.metrics["prefill_engine"] for c in completions]
        assert prefill_engines == [cluster.prefill_addresses[0], "", *cluster.prefill_addresses * 2]
        stats = wait_idle(client)
        assert stats and all(is_idle(s) for s in stats), stats
