"""Bad input to pdserve.LLM: a ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest

from pdserve.engine.request import SamplingParams


def _ok(tiny_llm) -> list[int]:
    completion = tiny_llm.generate(["hello world"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(completion.token_ids) == 4
    return completion.token_ids


def _assert_no_leak(tiny_llm) -> None:
    scheduler = tiny_llm.engine.scheduler
    assert not scheduler.has_requests()
    assert scheduler.requests == {}
    assert scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt_token_ids"),
        ([], "prompt_token_ids"),
        ([1] * 1024, "prompt_token_ids"),  # max_model_len is 1024
        ([-1, 2, 3], "prompt_token_ids"),
        ([10**9], "prompt_token_ids"),
    ],
    ids=["empty-text", "empty-ids", "too-long", "negative-id", "out-of-vocab-id"],
)
def test_bad_prompt_is_rejected_and_engine_keeps_serving(tiny_llm, prompt, field):
    before = _ok(tiny_llm)
    with pytest.raises(ValueError, match=field):
        tiny_llm.generate([prompt], SamplingParams(max_tokens=4))
    _assert_no_leak(tiny_llm)
    assert _ok(tiny_llm) == before


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_outside_vocab_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm.generate(["hi"], SamplingParams(max_tokens=4, stop_token_ids=[10**9]))
    _assert_no_leak(tiny_llm)


def test_prior_outputs_covering_the_whole_prompt_are_rejected(tiny_llm):
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, num_prior_output_tokens=3))
    _assert_no_leak(tiny_llm)


def test_one_bad_prompt_in_a_batch_queues_nothing(tiny_llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    _assert_no_leak(tiny_llm)
    _ok(tiny_llm)
