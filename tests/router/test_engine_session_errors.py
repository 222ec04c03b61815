"""The router's end of a Session when the whole stream breaks: each request on it fails as an
unreachable engine's would (UNAVAILABLE, retried or resumed elsewhere), whatever status the
broken stream ended with; a refusal of one request keeps its own status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.engine_session import EngineSession, rpc_error
from pdserve.v1 import engine_pb2
from tests.helpers.session_stub import ScriptedCall, SessionStub


async def _codes(status: grpc.StatusCode) -> tuple[list[grpc.StatusCode], ScriptedCall]:
    refusal = engine_pb2.SessionResponse(
        errors=[
            engine_pb2.RequestError(
                request_id="b", code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="no"
            )
        ]
    )
    call = ScriptedCall([refusal], error=rpc_error(status, "Internal error from Core"))
    session = EngineSession(SessionStub(call), "127.0.0.1:1")  # type: ignore[arg-type]
    streams = [session.open(engine_pb2.EngineGenerateRequest(request_id=r), timeout=10) for r in ("a", "b")]
    codes = []
    for stream in streams:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            async for _ in stream:
                pass
        codes.append(failure.value.code())
    await session.close()
    return codes, call


@pytest.mark.parametrize("status", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_a_broken_session_fails_its_requests_unavailable(status):
    codes, call = asyncio.run(_codes(status))
    assert codes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT]
    assert call.cancelled


def test_a_session_ended_unauthenticated_keeps_its_status():
    codes, _ = asyncio.run(_codes(grpc.StatusCode.UNAUTHENTICATED))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT]
