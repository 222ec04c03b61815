"""``pdserve decode``: a gRPC engine server with the consumer KV connector."""

from __future__ import annotations

import argparse

from pdserve.engine.server import add_engine_args, run_engine_server


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    return run_engine_server(args, role="decode", kv_role="consumer")
