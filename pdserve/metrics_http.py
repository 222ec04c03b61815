"""``/metrics`` over HTTP from a thread that sleeps until a scrape comes.

prometheus_client's ``start_http_server`` serves from ``serve_forever()``, which wakes twice a
second to ask whether it should stop. On a small machine whose cores the engines keep busy,
every wake-up of an idle process costs it a fraction of a millisecond of CPU (its caches are
cold), taken from an engine core; nothing here is ever asked to stop (a daemon thread, gone with
the process), so this server's thread blocks until a connection comes.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No access log on stderr (a scrape every few seconds)."""


def serve_wsgi(host: str, port: int, app: WsgiApp) -> None:
    """Serve ``app`` on ``host:port`` (IPv4 or IPv6, as the address resolves; "" is every IPv4
    address) from a daemon thread, for the life of the process (nothing shuts it down: its
    thread never looks)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
    server: WSGIServer = make_server(str(sockaddr[0]), port, app, server_class, handler_class=_QuietHandler)
    # poll_interval None: select() blocks until a connection (the interval only serves shutdown()).
    threading.Thread(target=server.serve_forever, args=(None,), name="metrics-http", daemon=True).start()
