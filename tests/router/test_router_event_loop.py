"""The router's event loop: uvloop by default, asyncio's on request or where uvloop is missing.

Routers started as processes (``pdserve cluster``, the end-to-end and reliability tests) run on
uvloop; the tests that run ``serve_router`` in their own process run it on asyncio's loop, so
the request path is exercised on both."""

from __future__ import annotations

import sys

import uvloop

from pdserve.router.server import event_loop_factory


def test_uvloop_by_default_and_asyncio_on_request():
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None


def test_without_uvloop_the_router_runs_on_asyncio(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop_factory("uvloop") is None
    assert "uvloop is not installed" in caplog.text
