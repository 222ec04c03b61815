"""Prometheus metrics of the router: requests, TTFT, inter-token latency, transfer time, load,
and the KV-event index (its size, events, replays, resyncs, and how well it predicted hits)."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from pdserve.metrics_http import serve_wsgi

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Engine-reported prefix hit minus the router's expectation, in blocks (0: exact).
_HIT_ERROR_BUCKETS = (-64, -16, -4, -2, -1, -0.5, 0, 0.5, 1, 2, 4, 16, 64)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts``, with one update of its sum and of each
    bucket hit: the same samples. The router observes every streamed token's gap; one ``observe``
    each (two locked increments and a walk of the bounds) was ~5% of its CPU per token on two
    busy cores. Reads prometheus_client's histogram fields (``_upper_bounds``, ``_buckets``,
    ``_sum``; pinned 0.26.0; a test holds the output to ``observe``'s)."""
    if not amounts:
        return
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds  # ascending, the last +Inf
    hits = [0] * len(bounds)
    for amount in amounts:
        hits[bisect.bisect_left(bounds, amount)] += 1  # the first bound >= amount, as observe
    for bucket, count in zip(histogram._buckets, hits, strict=True):
        if count:
            bucket.inc(count)
    histogram._sum.inc(sum(amounts))


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests", "Requests by how they ended", ["finish_reason"], registry=self.registry
        )
        self.rejected = Counter(
            "pdserve_router_rejected", "Requests refused", ["code"], registry=self.registry
        )
        self.resumed = Counter(
            "pdserve_router_decode_resumed",
            "Requests whose decode moved to another engine after its engine went away mid-stream",
            registry=self.registry,
        )
        self.routed = Counter(
            "pdserve_router_routed",
            "Requests by how they were served: disaggregated (prefill then decode), or colocated on "
            "a decode engine because the prompt's uncached part was short or the prefill engines "
            "were backlogged",
            ["path"],
            registry=self.registry,
        )
        self.streamed_tokens = Counter(
            "pdserve_router_streamed_tokens",
            "Tokens of streamed HTTP answers by what sent them: the engine session's reader, "
            "straight to the client (reader), or the request's task (task: a stage's first and "
            "last tokens, and every token of a stream with stop strings, several choices, or a "
            "client not reading)",
            ["path"],
            registry=self.registry,
        )
        self.relayed_tokens = Counter(
            "pdserve_router_relayed_tokens",
            "Of the reader's streamed tokens, those the C token relay wrote to the client "
            "(pdserve.router.token_relay; none with --no-token-relay or where no C compiler built it)",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.transfer = Histogram(
            "pdserve_router_transfer_seconds",
            "Prefill's first token -> decode's first token (KV pull + first decode step)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdserve_router_engine_in_flight",
            "Requests in flight per engine",
            ["role", "engine"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "pdserve_router_engine_healthy",
            "1 if the engine is in rotation",
            ["role", "engine"],
            registry=self.registry,
        )

        self.kv_index_blocks = Gauge(
            "pdserve_router_kv_index_blocks",
            "Blocks the KV-event index says each engine's prefix cache holds",
            ["engine"],
            registry=self.registry,
        )
        self.kv_events = Counter(
            "pdserve_router_kv_events",
            "KV-cache events applied to the index",
            ["engine"],
            registry=self.registry,
        )
        self.kv_events_rate = Gauge(
            "pdserve_router_kv_events_per_second",
            "KV-cache events applied per second (over the last 10 s)",
            ["engine"],
            registry=self.registry,
        )
        self.kv_in_sync = Gauge(
            "pdserve_router_kv_in_sync",
            "1 while the engine's index is exact (policy kv uses it; else prefix's guess)",
            ["engine"],
            registry=self.registry,
        )
        self.kv_replays = Counter(
            "pdserve_router_kv_replays",
            "Gaps in an engine's KV event sequence filled from its replay buffer",
            ["engine"],
            registry=self.registry,
        )
        self.kv_resyncs = Counter(
            "pdserve_router_kv_resyncs",
            "Gaps the replay buffer no longer covered: entries dropped, rebuilt from a snapshot",
            ["engine"],
            registry=self.registry,
        )
        self.kv_hit_error = Histogram(
            "pdserve_router_kv_hit_error_blocks",
            "Prefix-cache hit an engine reported minus the router's expectation, in blocks",
            ["role"],
            buckets=_HIT_ERROR_BUCKETS,
            registry=self.registry,
        )

        self.http_requests = Counter(
            "pdserve_router_http_requests",
            "HTTP requests to the OpenAI-compatible API by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )

        # The children the request path updates, by their label values (``requests_by(
        # finish_reason="stop")``): ``labels()`` looks one up in ~8 Python calls and a lock each
        # time, and these label sets are few (finish reasons, status codes, engines). The same
        # series: a child is made at its first use, as ``labels()`` makes it, and none is removed.
        self.requests_by = functools.cache(self.requests.labels)
        self.rejected_by = functools.cache(self.rejected.labels)
        self.routed_by = functools.cache(self.routed.labels)
        self.streamed_tokens_by = functools.cache(self.streamed_tokens.labels)
        self.in_flight_by = functools.cache(self.in_flight.labels)
        self.kv_hit_error_by = functools.cache(self.kv_hit_error.labels)
        self.http_requests_by = functools.cache(self.http_requests.labels)

    def serve(self, host: str, port: int, gate: Callable[[Callable], Callable] | None = None) -> None:
        """Serve /metrics on ``host:port`` from a thread; ``gate`` wraps the WSGI app (an API key
        check), in place before the first request can come."""
        app = make_wsgi_app(self.registry)
        serve_wsgi(host, port, gate(app) if gate is not None else app)
