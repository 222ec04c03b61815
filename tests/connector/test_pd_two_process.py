"""Prefill and decode as two processes, wired by hand: same greedy tokens as colocated.

For every transport available here, on the tiny model; once on the bundled SmolLM2 as well.
Afterwards both engines hold zero KV blocks and zero leases.
"""

from __future__ import annotations

import pytest

from pdserve.connector.transports import available_transports
from pdserve.engine.request import SamplingParams
from tests.helpers.pd import pd_generate, pd_pair, wait_idle
from tests.helpers.text_corpus import long_text

MAX_TOKENS = 8


def _prompts(tokenizer) -> list[list[int]]:
    # Partial last block, exactly one block, several blocks plus a partial one, a long prompt.
    ids = tokenizer.encode(long_text(4000))
    return [ids[:5], ids[100:116], ids[200:250], ids[300:700]]


@pytest.mark.parametrize("transport", available_transports())
def test_pd_matches_colocated_for_each_transport(transport, tiny_model_dir, tiny_llm):
    prompts = _prompts(tiny_llm.tokenizer)
    expected = [
        c.token_ids
        for c in tiny_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    with pd_pair(tiny_model_dir, transport) as (prefill, decode):
        got = []
        for i, prompt in enumerate(prompts):
            first, rest = pd_generate(prefill, decode, f"req-{i}", prompt, MAX_TOKENS)
            assert rest.finish_reason == "length"
            got.append(first.new_token_ids + rest.new_token_ids)
        assert got == expected
        decode_stats = wait_idle(decode)
        prefill_stats = wait_idle(prefill)
    assert decode_stats["kv_cache_usage"] == 0.0
    assert decode_stats["kv_connector"]["num_loads_ok"] == len(prompts)
    assert decode_stats["kv_connector"]["num_loads_failed"] == 0
    assert prefill_stats["kv_cache_usage"] == 0.0
    assert prefill_stats["num_held_blocks"] == 0
    assert prefill_stats["kv_connector"]["num_leases_released"] == len(prompts)


def test_partial_prefix_hit_on_decode_pulls_only_missing_blocks(tiny_model_dir):
    tokenizer_ids = list(range(10, 90))  # 80 tokens: 5 full blocks
    shared, tail = tokenizer_ids[:48], tokenizer_ids[48:]
    with pd_pair(tiny_model_dir, "tcp") as (prefill, decode):
        # Decode already computed the first 48 tokens (3 blocks) for another request.
        decode.generate("warm", shared + [5], SamplingParams(max_tokens=1, ignore_eos=True))
        first, rest = pd_generate(prefill, decode, "pd", shared + tail, MAX_TOKENS)
        assert rest.num_cached_tokens == 80  # 48 from the local prefix cache + 32 pulled
        stats = wait_idle(decode)
        assert stats["kv_connector"]["num_blocks_pulled"] == 2  # blocks 3 and 4 only
        assert wait_idle(prefill)["num_held_blocks"] == 0


@pytest.mark.slow
def test_pd_matches_colocated_on_bundled_model():
    from pdserve import LLM

    llm = LLM(max_model_len=2048, num_blocks=256)
    prompts = _prompts(llm.tokenizer)
    expected = [
        c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    with pd_pair(None, "auto") as (prefill, decode):
        got = []
        for i, prompt in enumerate(prompts):
            first, rest = pd_generate(prefill, decode, f"req-{i}", prompt, MAX_TOKENS)
            got.append(first.new_token_ids + rest.new_token_ids)
        assert got == expected
        assert wait_idle(decode)["kv_cache_usage"] == 0.0
        assert wait_idle(prefill)["num_held_blocks"] == 0
