"""The router's view of its engines: a gRPC stub each, health, and in-flight load.

A background task health-checks every engine once a second (the standard gRPC health
service): an engine that fails leaves the rotation at once and rejoins when it answers
SERVING again. Engines are also marked down the moment a call to them fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0
# How many prompt-block hashes the router remembers per engine for prefix-aware routing.
MAX_REMEMBERED_BLOCKS = 50_000


@dataclass(eq=False)
class EngineHandle:
    role: str  # "prefill" or "decode"
    address: str
    channel: grpc.aio.Channel = field(repr=False)
    stub: engine_pb2_grpc.EngineStub = field(repr=False)
    health: health_pb2_grpc.HealthStub = field(repr=False)
    healthy: bool = False
    info: engine_pb2.EngineInfo | None = None
    in_flight: int = 0  # requests the router has running on this engine
    # Recently sent prompt blocks (an LRU of chained block hashes): what its prefix cache may hold.
    recent_blocks: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def remember_blocks(self, block_hashes: list) -> None:
        for block_hash in block_hashes:
            self.recent_blocks[block_hash] = None
            self.recent_blocks.move_to_end(block_hash)
        while len(self.recent_blocks) > MAX_REMEMBERED_BLOCKS:
            self.recent_blocks.popitem(last=False)

    def cached_prefix_blocks(self, block_hashes: list) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.recent_blocks:
                break
            count += 1
        return count

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("%s engine %s is down: %s", self.role, self.address, reason)
        self.healthy = False


class EnginePool:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        options = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
        self.engines: list[EngineHandle] = []
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                channel = grpc.aio.insecure_channel(address, options=options)
                self.engines.append(
                    EngineHandle(
                        role=role,
                        address=address,
                        channel=channel,
                        stub=engine_pb2_grpc.EngineStub(channel),
                        health=health_pb2_grpc.HealthStub(channel),
                    )
                )
        self._task: asyncio.Task | None = None

    def of_role(self, role: str, healthy_only: bool = True) -> list[EngineHandle]:
        return [e for e in self.engines if e.role == role and (e.healthy or not healthy_only)]

    async def check(self, engine: EngineHandle) -> None:
        try:
            reply = await engine.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            serving, reason = False, exc.code().name
        else:
            reason = "not SERVING"
        if serving and (engine.info is None or not engine.healthy):
            try:
                engine.info = await engine.stub.Info(engine_pb2.InfoRequest(), timeout=HEALTH_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                serving, reason = False, f"Info failed: {exc.code().name}"
        if serving and not engine.healthy:
            logger.info("%s engine %s is healthy", engine.role, engine.address)
            engine.recent_blocks.clear()  # it may have restarted with an empty prefix cache
        if not serving:
            engine.mark_down(reason)
        engine.healthy = serving

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines))

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.check_all()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="engine-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for engine in self.engines:
            await engine.channel.close()
