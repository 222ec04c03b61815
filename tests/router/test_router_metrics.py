"""The router's batched histogram update gives the samples one ``observe`` a value would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.router.metrics import RouterMetrics, observe_many


def _exposition(histogram_of) -> tuple[bytes, float]:
    """The histogram's samples but its sum, and its sum (added in another order, it may differ in
    the last bits)."""
    registry = CollectorRegistry()
    histogram = Histogram("gap_seconds", "gaps", buckets=(0.005, 0.01, 0.025, 0.1, 1.0), registry=registry)
    histogram_of(histogram)
    lines = generate_latest(registry).splitlines()
    total = next(float(line.split()[1]) for line in lines if line.startswith(b"gap_seconds_sum"))
    kept = b"\n".join(line for line in lines if b"_created" not in line and b"_sum" not in line)
    return kept, total


def test_observe_many_gives_the_samples_of_one_observe_each():
    rng = random.Random(7)
    # On the bounds, between them, past the last one, zero: every bucket and the +Inf one.
    values = [0.0, 0.005, 0.01, 0.0100001, 0.025, 0.1, 1.0, 1.5, 40.0] + [
        rng.expovariate(60) for _ in range(500)
    ]

    def one_each(histogram: Histogram) -> None:
        for value in values:
            histogram.observe(value)

    def in_batches(histogram: Histogram) -> None:
        for start in range(0, len(values), 16):
            observe_many(histogram, values[start : start + 16])
        observe_many(histogram, [])

    expected, expected_sum = _exposition(one_each)
    assert b'gap_seconds_bucket{le="+Inf"} 509.0' in expected
    assert b'gap_seconds_bucket{le="0.01"}' in expected
    got, got_sum = _exposition(in_batches)
    assert got == expected
    assert abs(got_sum - expected_sum) <= 1e-12 * expected_sum


def test_the_routers_inter_token_histogram_counts_a_batch_of_gaps():
    metrics = RouterMetrics()
    observe_many(metrics.itl, [0.004, 0.013, 0.013, 3.0])
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_router_inter_token_latency_seconds_bucket{le="0.005"} 1.0' in text
    assert 'pdserve_router_inter_token_latency_seconds_bucket{le="0.025"} 3.0' in text
    assert "pdserve_router_inter_token_latency_seconds_count 4.0" in text
