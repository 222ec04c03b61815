"""``python -m pdserve.healthcheck HOST:PORT``: exit 0 iff the process there is SERVING.

The container health check of every pdserve process (the image's ``HEALTHCHECK`` and each
service's ``healthcheck`` in ``deploy/docker-compose.yml``). It asks the standard gRPC health
service (``grpc.health.v1.Health/Check``) that every engine and router serves: an engine reports
SERVING once its model is loaded and NOT_SERVING if its engine core dies; a router once a decode
engine answers. It prints the status, which ``docker inspect`` keeps with the health log.

Exit codes: 0 SERVING; 1 anything else (NOT_SERVING, no answer within ``--timeout``, nothing
listening), as Docker expects of a health check.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TIMEOUT_S = 3.0


def check(address: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """``(serving, status)``: status is the reported one (``SERVING``, ``NOT_SERVING``, ...) or the RPC error."""
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    serving, status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
