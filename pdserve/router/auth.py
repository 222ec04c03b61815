"""API keys on the router's front doors: which keys, where they come from, and the two gates.

A request proves itself with ``Authorization: Bearer KEY`` (HTTP) or ``authorization`` metadata
holding the same (gRPC). The gates let through what probes and scrapers need without a key:
gRPC's health service always (Kubernetes' and Docker's probes speak it and cannot send
metadata), and HTTP ``/health`` and ``/metrics`` unless ``--protect-metrics``, as in vLLM.

Keys are compared in constant time: each configured key's SHA-256 digest against the presented
key's, every one of them, with ``hmac.compare_digest``, so neither a key's length nor how many
of its bytes match shows in the time taken. No message or log line ever holds a key.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from pdserve.tls import ServerTls

KEYS_ENV = "PDSERVE_API_KEYS"  # comma-separated keys the router accepts
KEYS_FILE_ENV = "PDSERVE_API_KEYS_FILE"  # a file of keys, one a line
CLIENT_KEY_ENV = "PDSERVE_API_KEY"  # the key pdserve's own clients send when given none

# gRPC services open without a key: probes (grpc_health_probe, pdserve.healthcheck) use it.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
# HTTP paths open without a key unless --protect-metrics.
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})

MISSING = "missing API key: send the header 'Authorization: Bearer KEY'"
MISSING_GRPC = "missing API key: send the metadata 'authorization: Bearer KEY'"
INVALID = "invalid API key"


class ApiKeys:
    """The keys a router accepts; none means every request is let through.

    Only the SHA-256 digest of each key is kept: equal-length values for compare_digest,
    and no key text for a traceback or a debugger to show.
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [_digest(key) for key in dict.fromkeys(keys)]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, key: str | None) -> bool:
        """Whether ``key`` is one of the keys; every key is compared, in constant time."""
        if key is None:
            return False
        presented = _digest(key)
        match = False
        for digest in self._digests:
            match |= hmac.compare_digest(digest, presented)
        return match

    def check_authorization(self, header: str | None) -> str | None:
        """None if ``header`` (an Authorization value) holds an accepted key; else why not."""
        if not self:
            return None
        key = bearer_key(header)
        if key is None:
            return MISSING
        return None if self.accepts(key) else INVALID


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def bearer_key(header: str | None) -> str | None:
    """The key of ``Bearer KEY`` (the scheme in any case, as RFC 7235 has it); None if absent."""
    if not header:
        return None
    scheme, _, key = header.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


def check_key(key: str, source: str) -> str:
    """A key as given, or ValueError naming ``source`` (never the key): keys travel in HTTP
    headers and gRPC metadata, which take printable ASCII only."""
    if not key:
        raise ValueError(f"{source}: an API key is empty")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{source}: an API key has a space, a control or a non-ASCII character")
    return key


def load_api_keys(
    flags: Sequence[str] | None, key_file: str | None, environ: Mapping[str, str] = os.environ
) -> ApiKeys:
    """Every key from ``--api-key`` (repeated), ``$PDSERVE_API_KEYS`` (comma-separated) and the
    key file (``--api-key-file`` or ``$PDSERVE_API_KEYS_FILE``: one key a line, blank lines and
    ``#`` comments skipped). ValueError (naming the source, not the key) on a bad one."""
    keys = [check_key(k, "--api-key") for k in flags or ()]
    keys += [check_key(k.strip(), f"${KEYS_ENV}") for k in environ.get(KEYS_ENV, "").split(",") if k.strip()]
    key_file = key_file or environ.get(KEYS_FILE_ENV) or None
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"API key file {key_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"API key file {key_file}: not UTF-8 text") from None
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(check_key(line, f"API key file {key_file}, line {number}"))
    return ApiKeys(keys)


def client_metadata(
    api_key: str | None = None, environ: Mapping[str, str] = os.environ
) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata pdserve's own clients send: ``api_key``, else ``$PDSERVE_API_KEY``, else
    the first of ``$PDSERVE_API_KEYS`` (a shell that started a router with keys can reach it,
    and so can the benchmarks, whose routers inherit their environment); empty with none."""
    if api_key is None:
        api_key = environ.get(CLIENT_KEY_ENV) or next(
            (k.strip() for k in environ.get(KEYS_ENV, "").split(",") if k.strip()), None
        )
    if not api_key:
        return ()
    return (("authorization", f"Bearer {check_key(api_key, 'api_key')}"),)


def add_key_args(parser: argparse.ArgumentParser) -> None:
    """The API key options of every command that serves (or starts) a router."""
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"a key clients must send (Authorization: Bearer KEY); repeat for several. "
        f"${KEYS_ENV}=k1,k2 does the same and, unlike this, stays out of the process list",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"a file of keys, one a line (default: ${KEYS_FILE_ENV}); a Docker or Kubernetes secret",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        help="put HTTP /health and /metrics (and the --metrics-port) behind the key too; gRPC health stays open",
    )


def front_door_settings(args: argparse.Namespace) -> tuple[ApiKeys, ServerTls | None]:
    """The keys and TLS that ``add_key_args`` / ``add_tls_args`` options ask for, checked (keys,
    certificate files, ``--protect-metrics`` without a key): ValueError with a one-line reason,
    before anything is started."""
    keys = load_api_keys(args.api_key, args.api_key_file)
    tls = ServerTls.from_options(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    if args.protect_metrics and not keys:
        raise ValueError(
            "--protect-metrics needs an API key (--api-key, --api-key-file or $PDSERVE_API_KEYS)"
        )
    return keys, tls


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ssl-certfile", default=None, help="PEM certificate chain: serve TLS on gRPC and HTTP"
    )
    parser.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    parser.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="PEM CA certificates: clients must present a certificate they signed (mutual TLS)",
    )


# ---------------------------------------------------------------------- gRPC


class GrpcKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted key with UNAUTHENTICATED, before their body is parsed;
    the health service stays open."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        header = None
        for name, value in handler_call_details.invocation_metadata or ():
            if name == "authorization" and isinstance(value, str):
                header = value
                break
        refusal = self.keys.check_authorization(header)
        if refusal is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing(handler, MISSING_GRPC if refusal == MISSING else refusal)


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts UNAUTHENTICATED (raw bytes in: an
    unauthenticated body is never parsed)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse_stream)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


# ---------------------------------------------------------------------- HTTP


class HttpKeyMiddleware:
    """ASGI middleware: a request without an accepted ``Authorization: Bearer KEY`` gets 401 in
    OpenAI's error shape (what OpenAI itself answers, which its SDK raises as
    ``AuthenticationError``); ``open_paths`` need no key."""

    def __init__(self, app: Callable, keys: ApiKeys, open_paths: Iterable[str] = OPEN_HTTP_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        refusal = self.keys.check_authorization(header)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {
                "error": {
                    "message": refusal,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def wsgi_key_gate(app: Callable, keys: ApiKeys) -> Callable:
    """The same gate for a WSGI app (the --metrics-port Prometheus server), for every path."""

    def gated(environ: dict, start_response: Callable) -> Iterable[bytes]:
        refusal = keys.check_authorization(environ.get("HTTP_AUTHORIZATION"))
        if refusal is None:
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")],
        )
        return [f"{refusal}\n".encode()]

    return gated
