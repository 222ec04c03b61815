"""Requests and sampling parameters: bad input is a ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.request import Request, RequestStatus, SamplingParams, validate_prompt


def _raises_naming(field: str, build) -> None:
    with pytest.raises(ValueError, match=field):
        build()


# ------------------------------------------------------------------------------ sampling params


@pytest.mark.parametrize("max_tokens", [0, -1, 1.0, True, None])
def test_max_tokens_below_one_or_not_an_int_is_rejected(max_tokens):
    _raises_naming("max_tokens", lambda: SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("temperature", [-0.01, -1, math.nan, math.inf, "0.5", None])
def test_negative_or_non_finite_temperature_is_rejected(temperature):
    _raises_naming("temperature", lambda: SamplingParams(temperature=temperature))


@pytest.mark.parametrize("top_p", [0, 0.0, -0.5, 1.0001, 2, math.nan])
def test_top_p_outside_zero_one_is_rejected(top_p):
    _raises_naming("top_p", lambda: SamplingParams(top_p=top_p))


@pytest.mark.parametrize("top_p", [1e-6, 0.5, 1, 1.0])
def test_top_p_inside_zero_one_is_accepted(top_p):
    assert SamplingParams(top_p=top_p).top_p == top_p


@pytest.mark.parametrize("top_k", [0, -2, 1.5])
def test_bad_top_k_is_rejected(top_k):
    _raises_naming("top_k", lambda: SamplingParams(top_k=top_k))


def test_seed_must_be_an_int():
    _raises_naming("seed", lambda: SamplingParams(seed="42"))
    assert SamplingParams(seed=42).seed == 42


def test_stop_token_ids_must_be_token_ids_of_the_vocabulary():
    _raises_naming("stop_token_ids", lambda: SamplingParams(stop_token_ids=[-1]))
    params = SamplingParams(stop_token_ids=[5, 99])
    params.validate(vocab_size=100)
    _raises_naming("stop_token_ids", lambda: params.validate(vocab_size=99))


def test_sampling_params_defaults_are_greedy_and_stop_ids_normalised():
    params = SamplingParams(max_tokens=3, stop_token_ids=[7, 8])
    assert params.greedy
    assert params.stop_token_ids == (7, 8)
    assert params == SamplingParams(max_tokens=3, stop_token_ids=(7, 8))
    assert not SamplingParams(temperature=0.7).greedy


def test_sampling_params_are_immutable():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.max_tokens = 5  # type: ignore[misc]


# ------------------------------------------------------------------------------ prompts


def test_empty_prompt_is_rejected():
    _raises_naming("prompt_token_ids", lambda: validate_prompt([], max_model_len=16, vocab_size=100))


def test_prompt_as_long_as_max_model_len_is_rejected():
    # No room left to generate even one token.
    _raises_naming("prompt_token_ids", lambda: validate_prompt([1] * 16, max_model_len=16, vocab_size=100))
    _raises_naming("prompt_token_ids", lambda: validate_prompt([1] * 17, max_model_len=16, vocab_size=100))


def test_prompt_one_shorter_than_max_model_len_is_accepted():
    validate_prompt([1] * 15, max_model_len=16, vocab_size=100)


@pytest.mark.parametrize("bad_token", [-1, 100, 10**9, 1.0, True, "1", None])
def test_prompt_token_outside_vocabulary_is_rejected(bad_token):
    _raises_naming(
        "prompt_token_ids", lambda: validate_prompt([1, bad_token, 3], max_model_len=16, vocab_size=100)
    )


def test_prompt_token_ids_without_known_vocab_only_need_to_be_non_negative_ints():
    validate_prompt([0, 10**6], max_model_len=16, vocab_size=None)
    _raises_naming("prompt_token_ids", lambda: validate_prompt([-3], max_model_len=16, vocab_size=None))


def test_last_vocabulary_id_is_accepted():
    validate_prompt([0, 99], max_model_len=16, vocab_size=100)


# ------------------------------------------------------------------------------ request


def test_request_tracks_prompt_and_output_tokens():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=2)
    assert request.status == RequestStatus.WAITING
    assert request.num_prompt_tokens == request.num_tokens == 3
    assert request.num_computed_tokens == 0
    assert request.output_token_ids == []
    assert request.arrival_time is not None
    request.append_output_token_ids(9)
    assert request.output_token_ids == [9]
    assert request.all_token_ids == [1, 2, 3, 9]
    assert request.prompt_token_ids == [1, 2, 3]
    assert (request.num_tokens, request.num_output_tokens) == (4, 1)


def test_request_copies_its_prompt():
    prompt = [1, 2, 3]
    request = Request("r", prompt, SamplingParams())
    prompt.append(4)
    assert request.prompt_token_ids == [1, 2, 3]


def test_requests_compare_by_identity():
    a = Request("same", [1], SamplingParams(), arrival_time=1.0)
    b = Request("same", [1], SamplingParams(), arrival_time=1.0)
    assert a != b
    assert len({a, b}) == 2


@pytest.mark.parametrize(
    ("status", "finished", "reason"),
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.WAITING_FOR_REMOTE_KVS, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, True, "length"),
        (RequestStatus.FINISHED_ABORTED, True, "abort"),
        (RequestStatus.FINISHED_IGNORED, True, "length"),
        (RequestStatus.FINISHED_ERROR, True, "error"),
    ],
)
def test_request_status_finished_and_reason(status, finished, reason):
    assert RequestStatus.is_finished(status) is finished
    assert RequestStatus.get_finished_reason(status) == reason
