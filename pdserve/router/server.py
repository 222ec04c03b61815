"""``pdserve router``: the front doors of a P/D cluster: gRPC, and with ``--http-port`` the
OpenAI-compatible HTTP API, both on one event loop over one engine pool and request path.

Both doors take the same API keys (``pdserve.router.auth``) and the same TLS settings
(``pdserve.tls``), checked before anything starts: a bad key file or certificate is a one-line
error and exit code 2."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.auth import (
    KEYS_ENV,
    ApiKeys,
    GrpcKeyInterceptor,
    add_key_args,
    add_tls_args,
    front_door_settings,
    wsgi_key_gate,
)
from pdserve.router.engines import DEFAULT_DISCOVERY_INTERVAL_S, EnginePool
from pdserve.router.http_api import DEFAULT_MAX_BODY_BYTES, OpenAIServer
from pdserve.router.kv_subscriber import KVEventTracker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import DEFAULT_KV_LOAD_WEIGHT, POLICIES, RoutingPolicy
from pdserve.router.service import (
    DEFAULT_MAX_LOCAL_PREFILL_QUEUE_TOKENS,
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    DEFAULT_MAX_PREFILL_QUEUE,
    DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
    RouterServicer,
)
from pdserve.router.trace import TraceLog
from pdserve.tls import ServerTls
from pdserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
STARTUP_WAIT_S = 600.0
EVENT_LOOPS = ("uvloop", "asyncio")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument(
        "--prefill",
        default="",
        help="comma-separated prefill engines: HOST:PORT, or dns:NAME:PORT for every address of NAME",
    )
    parser.add_argument(
        "--decode",
        required=True,
        help="comma-separated decode engines: HOST:PORT, or dns:NAME:PORT for every address of NAME",
    )
    parser.add_argument(
        "--discovery-interval",
        type=float,
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        help="seconds between DNS lookups of dns: entries",
    )
    parser.add_argument(
        "--dns-server",
        default=None,
        help="HOST:PORT of the DNS server for dns: entries (default: the system's)",
    )
    parser.add_argument(
        "--model", default=None, help="the engines' model, for its tokenizer (default: bundled)"
    )
    parser.add_argument(
        "--policy",
        default="kv",
        choices=POLICIES,
        help="kv (the default): by what each engine's prefix cache holds, from the KV-cache events "
        "engines started with --kv-events-port publish; as prefix (the router's guess) for engines "
        "that publish none",
    )
    parser.add_argument(
        "--kv-load-weight",
        type=float,
        default=DEFAULT_KV_LOAD_WEIGHT,
        help="policy kv: score = matched blocks (held or pending) - WEIGHT x requests in flight "
        "(see pdserve.router.policies)",
    )
    parser.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=32,
        help="prompts with fewer uncached tokens than this skip prefill and run on decode (0: always P/D)",
    )
    parser.add_argument(
        "--max-prefill-queue",
        type=int,
        default=DEFAULT_MAX_PREFILL_QUEUE,
        help="when every prefill engine has this many prompts queued or running, a decode engine "
        "that is prefilling nothing itself takes the next prompt whole (0, or --disagg-min-tokens 0: never)",
    )
    parser.add_argument(
        "--max-prefill-queue-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
        help="or when every prefill engine has this many uncached prompt tokens queued or running "
        "(0: prompts only)",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        help="--max-prefill-queue moves prompts of at most this many uncached tokens to decode",
    )
    parser.add_argument(
        "--max-local-prefill-queue-tokens",
        type=int,
        default=DEFAULT_MAX_LOCAL_PREFILL_QUEUE_TOKENS,
        help="a decode engine prefilling prompts that way takes another only while their uncached "
        "tokens together stay within this (one prefilling nothing always takes one)",
    )
    parser.add_argument(
        "--max-inflight", type=int, default=256, help="beyond this, RESOURCE_EXHAUSTED (HTTP 429)"
    )
    parser.add_argument(
        "--no-token-relay",
        action="store_true",
        help="relay every streamed token in Python (by default a streaming answer's plain tokens "
        "are written to the client by a small C relay, where a C compiler builds it)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="uvloop",
        help="the router's event loop: uvloop (libuv's, in C: 7-9%% less router CPU a "
        "streamed token) or asyncio's own; uvloop falls back to asyncio where it is not installed",
    )
    parser.add_argument(
        "--http-port", type=int, default=None, help="serve the OpenAI-compatible API on http://HOST:PORT/v1"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the HTTP API (default: from the model file)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger HTTP bodies get 413",
    )
    parser.add_argument(
        "--trace-file",
        default=None,
        help="append one JSON line per finished request: its timeline (router, prefill, decode, KV pull events)",
    )
    add_key_args(parser)
    add_tls_args(parser)


def served_model_name(model: str | None) -> str:
    """The id clients name the model by: the bundled model's name, a file's stem, a directory's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


async def serve_router(
    args: argparse.Namespace, keys: ApiKeys | None = None, tls: ServerTls | None = None
) -> None:
    """Serve until SIGTERM/SIGINT; ``keys`` and ``tls`` as ``main`` loaded and checked them."""
    from pdserve.engine.model.loader import load_tokenizer

    keys = keys or ApiKeys()
    protect_metrics = bool(getattr(args, "protect_metrics", False))

    tokenizer = load_tokenizer(args.model)
    metrics = RouterMetrics()
    kv_events = KVEventTracker(metrics)
    pool = EnginePool(
        _addresses(args.prefill), _addresses(args.decode), args.discovery_interval, args.dns_server, kv_events
    )
    if args.metrics_port is not None:
        gate = (lambda app: wsgi_key_gate(app, keys)) if keys and protect_metrics else None
        metrics.serve(args.host, args.metrics_port, gate)
    trace = TraceLog(args.trace_file)
    policy = RoutingPolicy(args.policy, kv_events, args.kv_load_weight)
    servicer = RouterServicer(
        pool,
        tokenizer,
        policy,
        metrics,
        args.disagg_min_tokens,
        args.max_inflight,
        trace,
        max_prefill_queue=args.max_prefill_queue,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        max_local_prefill_queue_tokens=args.max_local_prefill_queue_tokens,
        token_relay=not getattr(args, "no_token_relay", False),
    )
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 16 << 20)],
        interceptors=[GrpcKeyInterceptor(keys)] if keys else None,
    )
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ROUTER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    # grpcio's health servicer starts out SERVING for "": say NOT_SERVING before the port opens,
    # or a readiness probe in the first instants sees a router that knows no engine yet.
    for service in ("", ROUTER_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{args.host}:{args.port}"
    if tls is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, tls.grpc_credentials())
    await server.start()
    http: OpenAIServer | None = None
    if args.http_port is not None:
        http = OpenAIServer(
            servicer,
            args.served_model_name or served_model_name(args.model),
            args.max_request_body_bytes,
            keys=keys,
            protect_metrics=protect_metrics,
            tls=tls,
        )
        await http.start(args.host, args.http_port)
    pool.start()
    # SERVING once at least one decode engine answers (a router with no engine serves nothing).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_WAIT_S
    while not pool.of_role("decode") and loop.time() < deadline:
        await asyncio.sleep(0.2)
    for service in ("", ROUTER_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "router serving on %s (%d engines, policy %s, %d API keys, %s, %s event loop)",
        address,
        len(pool.engines),
        args.policy,
        len(keys),
        "TLS" if tls else "plaintext",
        type(asyncio.get_running_loop()).__module__.split(".")[0],
    )
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "no API key: anyone who can reach %s can use this router (see --api-key, $%s)",
            args.host,
            KEYS_ENV,
        )
    if http is not None:
        scheme = "https" if tls else "http"
        print(f"pdserve router HTTP (OpenAI API) on {scheme}://{args.host}:{args.http_port}/v1", flush=True)
    print(f"pdserve router ready on {address}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if http is not None:
        await http.stop()
    await server.stop(5.0)
    await pool.close()
    trace.close()


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the router runs on: ``uvloop`` (what vLLM's API server runs on too) unless
    asked for asyncio's or not installed (None: asyncio's).

    Every token the router streams is a few trips through the loop (an engine frame read, a
    client chunk written, a task woken); libuv does in C what asyncio's selector loop does in
    Python, which on two cores shared with the engines was 85-91 against 92-104 us of CPU outside
    the engines a streamed token at 8 streams (docs/performance.md)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        logger.warning("uvloop is not installed: the router runs on asyncio's event loop")
        return None
    return uvloop.new_event_loop


def main(args: argparse.Namespace) -> int:
    try:
        keys, tls = front_door_settings(args)
        with asyncio.Runner(loop_factory=event_loop_factory(getattr(args, "event_loop", "uvloop"))) as runner:
            runner.run(serve_router(args, keys, tls))
    except ValueError as exc:  # a bad key or TLS file; a malformed --prefill / --decode / --dns-server entry
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
