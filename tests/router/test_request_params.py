"""The request path's shortcuts around the sampling params and the metrics give what the long
way gave: a stage's sampling message (made from the request's once, not from params rebuilt and
checked again per stage), and the metrics' cached children (the series ``labels()`` gives)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from pdserve.engine.request import SamplingParams
from pdserve.router.metrics import RouterMetrics
from pdserve.router.service import _stage_sampling
from pdserve.wire import sampling_to_proto

PARAMS = [
    SamplingParams(),
    SamplingParams(max_tokens=64, ignore_eos=True),
    SamplingParams(max_tokens=9, min_tokens=5, seed=-3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.1),
    SamplingParams(max_tokens=3, stop_token_ids=[7, 2], presence_penalty=-1.5, repetition_penalty=1.2),
]


@pytest.mark.parametrize("params", PARAMS)
def test_a_stages_sampling_message_is_that_of_its_params(params):
    base = sampling_to_proto(params)
    # The prefill stage (one token), then decode stages after 0, 1 and max - 1 tokens.
    counts = [(1, min(params.min_tokens, 1))] + [
        (params.max_tokens - done, max(0, params.min_tokens - done))
        for done in sorted({0, 1, params.max_tokens - 1})
        if params.max_tokens - done >= 1
    ]
    for max_tokens, min_tokens in counts:
        stage = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min_tokens)
        assert _stage_sampling(base, max_tokens, min_tokens) == sampling_to_proto(stage)
        assert _stage_sampling(base, max_tokens, min_tokens).SerializeToString(
            deterministic=True
        ) == sampling_to_proto(stage).SerializeToString(deterministic=True)
    assert base == sampling_to_proto(params)  # the request's own message is left as it was


def test_cached_metric_children_are_the_labelled_series():
    cached, plain = RouterMetrics(), RouterMetrics()
    for requests, in_flight, http in (
        (cached.requests_by, cached.in_flight_by, cached.http_requests_by),
        (plain.requests.labels, plain.in_flight.labels, plain.http_requests.labels),
    ):
        for reason in ("stop", "length", "stop"):
            requests(finish_reason=reason).inc()
        in_flight(role="decode", engine="10.0.0.1:50051").set(3)
        in_flight(role="decode", engine="10.0.0.1:50051").set(2)
        http(endpoint="/v1/completions", status="200").inc()
    assert cached.requests_by(finish_reason="stop") is cached.requests.labels(finish_reason="stop")
    assert _series(cached) == _series(plain)


def _series(metrics: RouterMetrics) -> list[str]:
    """The exposition's lines but for the creation times (which differ by registry)."""
    return [
        line for line in generate_latest(metrics.registry).decode().splitlines() if "_created" not in line
    ]
