"""Greedy output of pdserve.LLM == Hugging Face transformers on the bundled GGUF (fp32).

One HF reference per prompt (run alone, no padding), then pdserve runs all prompts as one
batch: plainly, with chunked prefill forced, on a warm prefix cache, and under preemption.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve import LLM
from pdserve.engine.model.loader import bundled_model_path
from pdserve.engine.request import SamplingParams
from tests.helpers.text_corpus import prompts_of_lengths

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [1, 7, 33, 100, 257, 512, 901, 1500]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=2048, num_blocks=1024)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return prompts_of_lengths(llm.tokenizer, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _assert_idle_and_leak_free(engine_llm: LLM) -> None:
    scheduler = engine_llm.engine.scheduler
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.usage == 0.0


@pytest.fixture(scope="module")
def cold_then_warm(llm: LLM, prompts: list[list[int]]) -> dict:
    """The batch on an empty prefix cache, then again on the cache it warmed: {"cold": its
    completions, "cold_left": (requests left, KV usage) after it, "warm": the rerun's
    completions}. The cold run is both the plain batch and the warm-up of the prefix-cache
    test, so the file runs the whole batch (~3,300 prompt tokens in fp32, a large share of its
    time) once less than if each test ran its own."""
    scheduler = llm.engine.scheduler
    scheduler.reset_prefix_cache()
    cold = llm.generate(prompts, _greedy())
    cold_left = (scheduler.has_requests(), scheduler.kv_cache_manager.usage)
    warm = llm.generate(prompts, _greedy())
    return {"cold": cold, "cold_left": cold_left, "warm": warm}


def test_batch_matches_transformers(cold_then_warm, hf_greedy):
    completions = cold_then_warm["cold"]
    assert [c.token_ids for c in completions] == hf_greedy
    assert all(c.finish_reason == "length" for c in completions)
    assert all(c.metrics["num_cached_tokens"] == 0 for c in completions)  # nothing was cached yet
    assert cold_then_warm["cold_left"] == (False, 0.0)  # idle and leak-free after the batch


def test_chunked_prefill_matches_transformers(prompts, hf_greedy):
    chunked = LLM(max_model_len=2048, max_num_batched_tokens=64, max_num_seqs=8, num_blocks=1024)
    completions = chunked.generate(prompts, _greedy())
    assert [c.token_ids for c in completions] == hf_greedy
    _assert_idle_and_leak_free(chunked)


def test_prefix_cache_hit_matches_transformers(llm, cold_then_warm, hf_greedy):
    completions = cold_then_warm["warm"]
    assert [c.token_ids for c in completions] == hf_greedy
    long_prompt = completions[-1]
    assert long_prompt.metrics["num_cached_tokens"] >= (1500 // 16 - 1) * 16
    _assert_idle_and_leak_free(llm)


def test_preemption_matches_transformers(prompts, hf_greedy):
    # 1,508 tokens need 95 blocks: 110 blocks cannot hold the batch, so requests get preempted.
    small = LLM(max_model_len=2048, max_num_batched_tokens=512, num_blocks=110, enable_prefix_caching=False)
    completions = small.generate(prompts, _greedy())
    assert small.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in completions] == hf_greedy
    _assert_idle_and_leak_free(small)
