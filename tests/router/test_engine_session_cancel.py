"""Cancelling a request on the router's end of a Session (the Abort RPC, a client gone) stops
its stream at once: messages the engine sent before the abort and the router has not relayed
yet, even the last one, are dropped, so an abort the router answered "found" never ends as a
finished request (once seen in CI: the whole answer was queued when the abort came)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.engine_session import EngineSession
from pdserve.v1 import engine_pb2
from tests.helpers.session_stub import ScriptedCall, SessionStub


def _output(token: int, finish_reason: str = "") -> engine_pb2.SessionResponse:
    return engine_pb2.SessionResponse(
        outputs=[
            engine_pb2.EngineGenerateResponse(request_id="a", token_ids=[token], finish_reason=finish_reason)
        ]
    )


async def _relayed_after_cancel(finished: bool) -> tuple[list[int], bool]:
    responses = [_output(t) for t in range(5)] + ([_output(5, "length")] if finished else [])
    call = ScriptedCall(responses)
    session = EngineSession(SessionStub(call), "127.0.0.1:1")  # type: ignore[arg-type]
    stream = session.open(engine_pb2.EngineGenerateRequest(request_id="a"), timeout=10)
    relayed: list[int] = []
    iterator = stream.__aiter__()
    relayed += (await iterator.__anext__()).token_ids
    await call.sent.wait()  # the rest of the answer is queued, not relayed
    stream.cancel()
    cancelled = False
    try:
        async for message in iterator:
            relayed += message.token_ids
    except asyncio.CancelledError:
        cancelled = True
    await session.close()
    return relayed, cancelled


@pytest.mark.parametrize("finished", [False, True], ids=["running", "finished-on-the-engine"])
def test_cancel_drops_what_the_router_has_not_relayed(finished):
    relayed, cancelled = asyncio.run(_relayed_after_cancel(finished))
    assert relayed == [0]
    assert cancelled
