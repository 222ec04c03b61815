"""Connector faults with two real engine processes: leases, dead peers, bad handshakes.

Each test ends with every engine back to zero KV usage and zero held blocks.
"""

from __future__ import annotations

import time

import pytest

from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.request import SamplingParams
from tests.helpers.pd import engine_config, pd_generate, pd_pair, wait_idle

PROMPT = list(range(10, 74))  # 64 tokens: 4 full blocks
MAX_TOKENS = 6
STALL = {"transport_options": {"fault": {"after_bytes": 0, "action": "stall"}}}


def _wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def _expected(tiny_llm) -> list[int]:
    return tiny_llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids


def _start_pull(prefill: EngineCoreClient, decode: EngineCoreClient, request_id: str) -> list[int]:
    """Prefill's first token, then hand the request to decode without waiting for it."""
    first = prefill.generate(
        request_id,
        PROMPT,
        SamplingParams(max_tokens=1, ignore_eos=True),
        kv_transfer_params={"do_remote_decode": True},
    )
    decode.add_request(
        request_id,
        PROMPT + first.new_token_ids,
        SamplingParams(max_tokens=MAX_TOKENS - 1, ignore_eos=True),
        kv_transfer_params=first.kv_transfer_params,
    )
    _wait_for(lambda: decode.stats()["num_waiting_for_remote_kvs"] == 1, 10, "decode to start pulling")
    return first.new_token_ids


def _collect(decode: EngineCoreClient, request_id: str, timeout_s: float):
    tokens, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for output in decode.get_outputs(timeout_s=0.1):
            assert output.request_id == request_id
            tokens.extend(output.new_token_ids)
            if output.finished:
                return tokens, output
    raise AssertionError(f"{request_id} did not finish within {timeout_s}s")


def test_lease_expiry_frees_prefill_blocks(tiny_model_dir):
    with EngineCoreClient(engine_config(tiny_model_dir, "producer", "tcp", lease_ms=600)) as prefill:
        out = prefill.generate(
            "held", PROMPT, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True}
        )
        assert out.kv_transfer_params["remote_block_ids"], out
        assert prefill.stats()["num_held_blocks"] == 4
        # Nobody pulls: the lease runs out and the blocks come back.
        waited = _wait_for(lambda: prefill.stats()["num_held_blocks"] == 0, 5, "the lease to expire")
        stats = prefill.stats()
        assert stats["kv_cache_usage"] == 0.0
        assert stats["kv_connector"]["num_leases_expired"] == 1
        assert waited < 3


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_mid_transfer(tiny_model_dir, tiny_llm, policy):
    expected = _expected(tiny_llm)
    prefill = EngineCoreClient(engine_config(tiny_model_dir, "producer", "tcp", extra=STALL))
    decode_config = engine_config(tiny_model_dir, "consumer", "tcp", transfer_timeout_s=30.0)
    decode_config.scheduler.kv_load_failure_policy = policy
    with EngineCoreClient(decode_config) as decode:
        try:
            first = _start_pull(prefill, decode, "r1")
        finally:
            prefill.proc.kill()  # kill -9 while the pull is stalled mid-way
            prefill.close()
        tokens, last = _collect(decode, "r1", timeout_s=15)
        if policy == "recompute":
            assert first + tokens == expected
            assert last.finish_reason == "length"
        else:
            assert last.finish_reason == "error"
            assert last.stop_reason == "kv_load_failed"
        stats = wait_idle(decode)
        assert stats["kv_cache_usage"] == 0.0
        assert stats["kv_connector"]["num_loads_failed"] == 1


def test_stalled_transfer_ends_at_decode_timeout(tiny_model_dir, tiny_llm):
    expected = _expected(tiny_llm)
    with pd_pair(
        tiny_model_dir, "tcp", prefill_kv={"extra": STALL}, decode_kv={"transfer_timeout_s": 1.0}
    ) as (
        prefill,
        decode,
    ):
        start = time.monotonic()
        first = _start_pull(prefill, decode, "slow")
        tokens, last = _collect(decode, "slow", timeout_s=15)
        assert time.monotonic() - start >= 1.0
        assert first + tokens == expected  # recomputed locally after the timeout
        assert wait_idle(decode)["kv_connector"]["num_loads_failed"] == 1
        # Decode told prefill to release even though the pull failed.
        assert wait_idle(prefill)["num_held_blocks"] == 0


def test_decode_killed_mid_transfer_prefill_frees_within_lease(tiny_model_dir):
    prefill = EngineCoreClient(engine_config(tiny_model_dir, "producer", "tcp", lease_ms=1500, extra=STALL))
    with prefill:
        decode = EngineCoreClient(engine_config(tiny_model_dir, "consumer", "tcp", transfer_timeout_s=30.0))
        try:
            _start_pull(prefill, decode, "orphan")
            assert prefill.stats()["num_held_blocks"] == 4
        finally:
            decode.proc.kill()
            decode.close()
        waited = _wait_for(
            lambda: prefill.stats()["num_held_blocks"] == 0, 6, "prefill to free the orphaned blocks"
        )
        assert waited < 4  # within the 1.5 s lease (+ polling slack)
        assert prefill.stats()["kv_cache_usage"] == 0.0


def test_layout_mismatch_is_a_clear_handshake_error(tiny_model_dir, tiny_llm):
    expected = _expected(tiny_llm)
    prefill = EngineCoreClient(engine_config(tiny_model_dir, "producer", "tcp"))
    decode_config = engine_config(tiny_model_dir, "consumer", "tcp")
    decode_config.cache.block_size = 32
    with prefill, EngineCoreClient(decode_config) as decode:
        first, rest = pd_generate(prefill, decode, "mismatch", PROMPT, MAX_TOKENS)
        assert first.new_token_ids + rest.new_token_ids == expected  # recomputed locally
        stats = wait_idle(decode)
        assert stats["kv_connector"]["num_loads_failed"] == 1
        assert "KV layout mismatch" in stats["kv_connector"]["last_load_error"]
        assert "block_size" in stats["kv_connector"]["last_load_error"]
        assert wait_idle(prefill)["num_held_blocks"] == 0


def test_blocks_freed_during_a_pull_are_never_used(tiny_model_dir, tiny_llm):
    """Prefill aborts a held request while decode's pull is stalled, and a new prompt reuses
    those blocks before the pull resumes: decode must not keep the overwritten KV (it would
    silently generate garbage); it detects the lost lease and recomputes."""
    expected = _expected(tiny_llm)
    stall_once = {
        "transport_options": {"fault": {"after_bytes": 0, "action": "stall", "stall_s": 2.0, "times": 1}}
    }
    prefill_config = engine_config(tiny_model_dir, "producer", "tcp", extra=stall_once, num_blocks=8)
    prefill_config.scheduler.max_model_len = 128
    prefill_config.scheduler.max_num_batched_tokens = 128
    with (
        EngineCoreClient(prefill_config) as prefill,
        EngineCoreClient(engine_config(tiny_model_dir, "consumer", "tcp", transfer_timeout_s=30.0)) as decode,
    ):
        _start_pull(prefill, decode, "victim")
        prefill.abort(["victim"])
        _wait_for(lambda: prefill.stats()["num_held_blocks"] == 0, 5, "prefill to drop the aborted request")
        # 120 new tokens need all 8 blocks: the victim's blocks are overwritten.
        reuse = prefill.generate(
            "reuse", list(range(150, 270)), SamplingParams(max_tokens=1, ignore_eos=True)
        )
        assert reuse.finish_reason == "length"
        tokens, last = _collect(decode, "victim", timeout_s=15)
        assert last.finish_reason == "length"
        stats = wait_idle(decode)
        assert stats["kv_connector"]["num_loads_failed"] == 1
        assert "no longer held" in stats["kv_connector"]["last_load_error"]
        assert PROMPT and tokens == expected[1:]
        assert wait_idle(prefill)["kv_cache_usage"] == 0.0
