"""``python -m pdserve.healthcheck HOST:PORT``: exit 0 iff the process there is SERVING.

The container health check of every pdserve process (the image's ``HEALTHCHECK`` and each
service's ``healthcheck`` in ``deploy/docker-compose.yml``). It asks the standard gRPC health
service (``grpc.health.v1.Health/Check``) that every engine and router serves: an engine reports
SERVING once its model is loaded and NOT_SERVING if its engine core dies; a router once a decode
engine answers. It prints the status, which ``docker inspect`` keeps with the health log.

The health service needs no API key. A router serving TLS is checked with ``--tls`` (and
``--ssl-ca-certs`` for a private CA, ``--server-name`` when the certificate does not name the
address dialled, ``--ssl-certfile``/``--ssl-keyfile`` under mutual TLS).

Exit codes: 0 SERVING; 1 anything else (NOT_SERVING, no answer within ``--timeout``, nothing
listening), as Docker expects of a health check.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.tls import ClientTls, TlsError, grpc_channel

DEFAULT_TIMEOUT_S = 3.0


def check(
    address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, tls: ClientTls | None = None
) -> tuple[bool, str]:
    """``(serving, status)``: status is the reported one (``SERVING``, ``NOT_SERVING``, ...) or the RPC error."""
    with grpc_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.healthcheck", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("address", help="HOST:PORT of the process's gRPC server, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help='health service name ("" is the whole server)')
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for an answer"
    )
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS (implied by the --ssl-* options)"
    )
    parser.add_argument(
        "--ssl-ca-certs", default=None, help="PEM roots to verify the server with (default: the system's)"
    )
    parser.add_argument("--ssl-certfile", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--ssl-keyfile", default=None, help="its private key")
    parser.add_argument("--server-name", default=None, help="the name the server's certificate must hold")
    args = parser.parse_args(argv)
    tls = None
    try:
        if args.tls or args.ssl_ca_certs or args.ssl_certfile or args.server_name:
            tls = ClientTls(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile, args.server_name)
        serving, status = check(args.address, args.service, args.timeout, tls)
    except TlsError as exc:
        serving, status = False, f"error: {exc}"
    print(f"{args.address}: {status}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
