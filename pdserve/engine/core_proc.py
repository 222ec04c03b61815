"""The engine core process: ``python -m pdserve.engine.core_proc`` (EngineConfig JSON on stdin).

Connects to the front's two ZMQ IPC sockets (inputs, outputs), loads the model, reports READY
and runs ``EngineCore.run_busy_loop``. It exits when told to, or when its parent process dies,
so a killed front never leaves a core holding memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

import zmq

from pdserve.engine import messages
from pdserve.engine.core import AbortRequests, EngineCore, EngineCoreRequest
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.outputs import EngineCoreOutput

logger = logging.getLogger("pdserve.core")


def build_engine_core(config: EngineConfig) -> EngineCore:
    from pdserve.engine.model.loader import load_model

    loaded = load_model(config.model.path, dtype=config.model.dtype)
    connector = None
    if config.kv_transfer is not None:
        from pdserve.connector.factory import create_connector

        spec = loaded.arch.kv_cache_spec(config.cache.block_size, config.model.dtype)
        connector = create_connector(config.kv_transfer, spec)
    return EngineCore(loaded, config.scheduler, config.cache, connector, kv_cache_dtype=config.model.dtype)


class CoreServer:
    """Translates ZMQ messages to EngineCore calls and outputs back to messages."""

    def __init__(self, core: EngineCore, input_addr: str, output_addr: str) -> None:
        self.core = core
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PULL)
        self.inputs.connect(input_addr)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)
        self.parent_pid = os.getppid()
        self.stopping = False

    def send(self, message: dict[str, Any]) -> None:
        self.outputs.send(messages.encode(message))

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        self.send({"type": messages.OUTPUTS, "outputs": [messages.output_to_dict(o) for o in outputs]})

    def receive(self, timeout: float | None) -> list[Any]:
        if os.getppid() != self.parent_pid:
            logger.warning("front process is gone; shutting down")
            self.stopping = True
            return []
        items: list[Any] = []
        wait_ms = None if timeout is None else int(timeout * 1000)
        while self.poller.poll(wait_ms):
            wait_ms = 0
            try:
                message = messages.decode(self.inputs.recv())
                item = self._translate(message)
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("dropped malformed input: %s", exc)
                continue
            if item is not None:
                items.append(item)
        return items

    def _translate(self, message: dict[str, Any]) -> Any:
        kind = message["type"]
        if kind == messages.ADD:
            request = EngineCoreRequest(
                request_id=message["request_id"],
                prompt_token_ids=list(message["prompt_token_ids"]),
                sampling_params=messages.sampling_from_dict(message.get("sampling_params") or {}),
                arrival_time=message.get("arrival_time"),
                priority=int(message.get("priority", 0)),
                kv_transfer_params=message.get("kv_transfer_params"),
            )
            return request
        if kind == messages.ABORT:
            return AbortRequests(list(message["request_ids"]))
        if kind == messages.STATS:
            stats = messages.stats_to_dict(self.core.stats())
            self.send({"type": messages.STATS_REPLY, "stats": stats, "nonce": message.get("nonce")})
            return None
        if kind == messages.RESET_PREFIX_CACHE:
            ok = self.core.scheduler.reset_prefix_cache()
            self.send({"type": messages.STATS_REPLY, "reset": ok, "nonce": message.get("nonce")})
            return None
        if kind == messages.SHUTDOWN:
            self.stopping = True
            return None
        raise ValueError(f"unknown message type {kind!r}")

    def serve(self) -> None:
        self.core.run_busy_loop(self.receive, self.emit, lambda: self.stopping)

    def close(self) -> None:
        self.core.shutdown()
        self.inputs.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-core")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s core[%(process)d] %(name)s: %(message)s"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = EngineConfig.from_json(sys.stdin.read())  # see core_client.spawn_core
    server = None
    try:
        core = build_engine_core(config)
        server = CoreServer(core, args.input, args.output)
        info = {
            "vocab_size": core.vocab_size,
            "eos_token_id": core.eos_token_id,
            "max_model_len": config.scheduler.max_model_len,
            "num_blocks": config.cache.num_blocks,
            "block_size": config.cache.block_size,
            "connector": core.connector.describe() if core.connector is not None else None,
        }
        server.send({"type": messages.READY, "info": info})
        logger.info("engine core ready (%s)", info)
        server.serve()
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
