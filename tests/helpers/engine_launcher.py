"""``python -m tests.helpers.engine_launcher prefill|decode [engine args] [--tcp-fault JSON]``.

Runs the real engine server (``pdserve.engine.server.serve_engine``) with one thing the
command line cannot express: a fault injected into the tcp transport's serving side
(``KVTransferConfig.extra["transport_options"]["fault"]``, the ``TcpFault`` test hook), e.g.
``--tcp-fault '{"action": "stall", "stall_s": 1.0}'``. Everything else is parsed by the
engine's own ``add_engine_args``, so the process is ``pdserve prefill|decode`` otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from pdserve.engine.core_client import EngineCoreError
from pdserve.engine.server import add_engine_args, engine_config_from_args, serve_engine

KV_ROLES = {"prefill": "producer", "decode": "consumer"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_launcher")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("role", choices=sorted(KV_ROLES))
    parser.add_argument("--tcp-fault", default=None, help="TcpFault fields as JSON (tcp transport only)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = engine_config_from_args(args, KV_ROLES[args.role])
    if args.tcp_fault:
        assert config.kv_transfer is not None
        config.kv_transfer.extra = {"transport_options": {"fault": json.loads(args.tcp_fault)}}
    try:
        asyncio.run(serve_engine(config, args.role, args.host, args.port, args.metrics_port))
    except EngineCoreError as exc:
        logging.getLogger(__name__).error("%s engine failed to start: %s", args.role, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
