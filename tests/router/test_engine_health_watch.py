"""The router's pool follows each engine's health on the health service's Watch stream: an
engine that turns NOT_SERVING (a drain) leaves the rotation without waiting for a poll, comes
back when it is SERVING again, and one marked down by a failed call while its health still says
SERVING is asked again and rejoins. In-process: a gRPC health server and an ``EnginePool``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router.engines import HEALTH_INTERVAL_S, EnginePool
from pdserve.supervisor import pick_free_ports
from pdserve.v1 import engine_pb2, engine_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _InfoOnly(engine_pb2_grpc.EngineServicer):
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures  # the first Info calls answered UNAVAILABLE

    async def Info(self, request, context):
        if self.failures > 0:
            self.failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return engine_pb2.EngineInfo(role="decode")


async def _serve(info: _InfoOnly) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    (port,) = pick_free_ports("127.0.0.1", 1)
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    engine_pb2_grpc.add_EngineServicer_to_server(info, server)  # asked each time it turns healthy
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set("", SERVING)
    return server, servicer, port


async def _until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``condition()`` holds; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return loop.time() - start


def test_health_changes_reach_the_rotation_without_polling_and_a_marked_down_engine_rejoins():
    async def run() -> None:
        server, servicer, port = await _serve(_InfoOnly())
        pool = EnginePool([], [f"127.0.0.1:{port}"])
        (engine,) = pool.engines
        pool.start()
        try:
            await _until(lambda: engine.healthy, 5.0)
            await servicer.set("", NOT_SERVING)  # a drain begins
            assert await _until(lambda: not engine.healthy, 5.0) < HEALTH_INTERVAL_S / 2
            await asyncio.sleep(2 * HEALTH_INTERVAL_S)
            assert not engine.healthy, "a NOT_SERVING engine came back into rotation"
            await servicer.set("", SERVING)
            await _until(lambda: engine.healthy, 5.0)
            engine.mark_down("a call failed UNAVAILABLE")  # its health still says SERVING
            assert not engine.healthy
            await _until(lambda: engine.healthy, 3 * HEALTH_INTERVAL_S)
            await server.stop(0)  # the engine is gone: the stream breaks
            await _until(lambda: not engine.healthy, 5.0)
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(run())


def test_an_engine_whose_info_failed_while_serving_is_asked_again_and_joins():
    """Its Watch stream says SERVING once and then nothing (no change): the failed Info must not
    leave it out of the rotation for good."""

    async def run() -> None:
        server, _, port = await _serve(_InfoOnly(failures=1))
        pool = EnginePool([], [f"127.0.0.1:{port}"])
        (engine,) = pool.engines
        pool.start()
        try:
            await _until(lambda: engine.healthy, 3 * HEALTH_INTERVAL_S + 2)
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(run())
