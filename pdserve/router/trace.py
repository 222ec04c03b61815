"""The router's structured trace log: one JSON line per finished request, with its timeline.

The same timeline reaches the client in the final message's ``RequestMetrics.timeline_ms``;
this file is for operators who want it for every request without changing clients (tail it,
or load it with pandas). Events are milliseconds since the router received the request; the
engines' events come from their own clocks (wall time), so across hosts they are only as good
as the clocks' sync.
"""

from __future__ import annotations

import json
import logging
import time
from typing import IO, Any

logger = logging.getLogger(__name__)


class TraceLog:
    """Appends ``{"request_id", "time", "metrics": {...}, "timeline_ms": {...}}`` lines, or
    does nothing when no path is given; a write error is logged once, never raised (tracing
    must not fail requests)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._failed = False

    def write(self, request_id: str, metrics: Any) -> None:
        if self._file is None:
            return
        timeline = dict(sorted(metrics.timeline_ms.items(), key=lambda item: item[1]))
        record = {
            "request_id": request_id,
            "time": time.time(),
            "prefill_engine": metrics.prefill_engine,
            "decode_engine": metrics.decode_engine,
            "ttft_ms": round(metrics.ttft_ms, 3),
            "transfer_ms": round(metrics.transfer_ms, 3),
            "timeline_ms": {event: round(ms, 3) for event, ms in timeline.items()},
        }
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:
            if not self._failed:
                logger.error("trace log %s: %s (no more traces will be written)", self.path, exc)
            self._failed = True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
