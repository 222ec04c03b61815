"""Prometheus metrics of one engine process, served on their own port (``/metrics``).

The scheduler's gauges, and the tokens and finished requests the core counts, are read from the
core when a scrape comes, not on a timer: asking the core once a second woke the front (and the
core) every second, about 3 ms of the front's CPU a second on a 2-core VM, taken from the engine
cores whether anyone looked or not. The core counts every request (the front is not on a framed
session's request path at all, ``core_sessions``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.engine.outputs import SchedulerStats
from pdserve.metrics_http import serve_wsgi

logger = logging.getLogger(__name__)


class EngineMetrics:
    def __init__(self, role: str, address: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "engine": address}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.kv_usage = gauge("pdserve_engine_kv_cache_usage", "Fraction of KV blocks referenced by requests")
        self.running = gauge("pdserve_engine_num_running", "Requests running")
        self.waiting = gauge("pdserve_engine_num_waiting", "Requests waiting (incl. for remote KV)")
        self.waiting_remote = gauge(
            "pdserve_engine_num_waiting_for_remote_kvs", "Requests waiting for remote KV"
        )
        self.held_blocks = gauge(
            "pdserve_engine_num_held_blocks", "Blocks held for remote decode under a lease"
        )
        self.blocks_pulled = gauge("pdserve_engine_kv_blocks_pulled", "KV blocks pulled from prefill engines")
        self.loads_failed = gauge("pdserve_engine_kv_loads_failed", "Remote KV loads that failed")
        self.leases_expired = gauge("pdserve_engine_kv_leases_expired", "Held-block leases that expired")
        self.weight_bytes = gauge(
            "pdserve_engine_weight_bytes", "Bytes the model's weights take in memory (after --quantization)"
        )
        self.counted = _CoreCounts(labels)
        self.registry.register(self.counted)

    def observe_stats(self, stats: SchedulerStats) -> None:
        self.kv_usage.set(stats.kv_cache_usage)
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.waiting_remote.set(stats.num_waiting_for_remote_kvs)
        self.held_blocks.set(stats.num_held_blocks)
        # The connector's own counters: none without a connector (a colocated engine).
        connector = stats.kv_connector
        self.blocks_pulled.set(connector.get("num_blocks_pulled", 0))
        self.loads_failed.set(connector.get("num_loads_failed", 0))
        self.leases_expired.set(connector.get("num_leases_expired", 0))
        self.counted.tokens = stats.num_generated_tokens
        self.counted.finished = dict(stats.num_finished)

    def serve(self, host: str, port: int, stats: Callable[[], SchedulerStats | None]) -> None:
        """Serve /metrics on ``host:port`` from a thread. ``stats``: the core's scheduler stats
        (None: no core to ask), asked at each scrape, one scrape at a time (one snapshot per
        answer); a failure leaves the last values and says why."""
        metrics_app = make_wsgi_app(self.registry)
        one_scrape = threading.Lock()

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            if environ.get("PATH_INFO") == "/favicon.ico":
                return metrics_app(environ, start_response)
            with one_scrape:
                try:
                    current = stats()
                except Exception as exc:  # a stuck core: the scrape still answers
                    logger.warning(
                        "metrics scrape: no scheduler stats from the core (%s)",
                        str(exc) or type(exc).__name__,
                    )
                else:
                    if current is not None:
                        self.observe_stats(current)
                return metrics_app(environ, start_response)

        serve_wsgi(host, port, app)


class _CoreCounts(Collector):
    """The core's counters as of the last scrape's stats (``SchedulerStats``)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.tokens = 0
        self.finished: dict[str, int] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        names, values = list(self.labels), list(self.labels.values())
        tokens = CounterMetricFamily("pdserve_engine_generated_tokens", "Generated tokens", labels=names)
        tokens.add_metric(values, self.tokens)
        finished = CounterMetricFamily(
            "pdserve_engine_requests_finished", "Finished requests", labels=[*names, "finish_reason"]
        )
        for reason, count in sorted(self.finished.items()):
            finished.add_metric([*values, reason], count)
        yield tokens
        yield finished
