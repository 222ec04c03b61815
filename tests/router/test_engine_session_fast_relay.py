"""A request's plain tokens relayed in the engine session's reader (``SessionStream.fast``):
every message reaches the client once and in order whichever way it goes, a relay that
declines hands that message and the ones after it to the request's iterator, and a relay
that raises fails its own request (INTERNAL), not the session's others."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.engine_session import EngineSession
from pdserve.v1 import engine_pb2
from tests.helpers.session_stub import ScriptedCall, SessionStub


def _step(*outputs: tuple[str, int, str]) -> engine_pb2.SessionResponse:
    return engine_pb2.SessionResponse(
        outputs=[
            engine_pb2.EngineGenerateResponse(request_id=rid, token_ids=[token], finish_reason=finish)
            for rid, token, finish in outputs
        ]
    )


async def _relay_in_order(pause: bool) -> tuple[list[tuple[str, int]], int]:
    """20 tokens of one request, the last one finishing it; the reader's relay takes each
    token but every fourth and the last, which it declines (as the request path's does)."""
    responses = [_step(("a", t, "length" if t == 19 else "")) for t in range(20)]
    call = ScriptedCall(responses, pause=pause)
    session = EngineSession(SessionStub(call), "127.0.0.1:1")  # type: ignore[arg-type]
    stream = session.open(engine_pb2.EngineGenerateRequest(request_id="a"), timeout=10)
    sent: list[tuple[str, int]] = []
    offered = 0

    def relay(message: engine_pb2.EngineGenerateResponse) -> bool:
        nonlocal offered
        offered += 1
        if message.finish_reason or message.token_ids[0] % 4 == 3:
            return False
        sent.append(("reader", message.token_ids[0]))
        return True

    async for message in stream:
        sent.append(("task", message.token_ids[0]))
        stream.fast = relay  # as the request path does once a stage's first token went out
    await session.close()
    return sent, offered


@pytest.mark.parametrize("pause", [False, True], ids=["frames-together", "frames-apart"])
def test_every_token_goes_once_and_in_order_whoever_relays_it(pause):
    sent, offered = asyncio.run(_relay_in_order(pause))
    assert [token for _, token in sent] == list(range(20))
    assert sent[0] == ("task", 0) and sent[-1] == ("task", 19)
    declined = [token for who, token in sent if who == "task" and token % 4 == 3]
    assert declined == [3, 7, 11, 15, 19]  # each declined token went through the task
    if pause:
        # Frames apart: once the task has sent what it was given, the reader relays again.
        assert ("reader", 4) in sent and ("reader", 16) in sent
        assert offered == 19  # every token but the first (no relay yet)
    else:
        # Frames together: all of them came before the task took the first, so all queued.
        assert all(who == "task" for who, _ in sent) and offered == 0


async def _one_relay_raises() -> tuple[list[int], grpc.StatusCode | None, list[int]]:
    responses = [_step(("a", t, ""), ("b", 100 + t, "length" if t == 9 else "")) for t in range(10)]
    call = ScriptedCall(responses, pause=True)
    session = EngineSession(SessionStub(call), "127.0.0.1:1")  # type: ignore[arg-type]
    a = session.open(engine_pb2.EngineGenerateRequest(request_id="a"), timeout=10)
    b = session.open(engine_pb2.EngineGenerateRequest(request_id="b"), timeout=10)

    def broken(message: engine_pb2.EngineGenerateResponse) -> bool:
        if message.token_ids[0] == 3:
            raise ValueError("a bug in the relay")
        return False

    got_a: list[int] = []
    code = None

    async def read_a() -> None:
        nonlocal code
        try:
            async for message in a:
                got_a.extend(message.token_ids)
                a.fast = broken
        except grpc.aio.AioRpcError as exc:
            code = exc.code()

    async def read_b() -> list[int]:
        return [t async for message in b for t in message.token_ids]

    _, got_b = await asyncio.gather(read_a(), read_b())
    await session.close()
    return got_a, code, got_b


def test_a_relay_that_raises_fails_its_request_not_the_session():
    got_a, code, got_b = asyncio.run(_one_relay_raises())
    assert got_a == [0, 1, 2] and code == grpc.StatusCode.INTERNAL
    assert got_b == list(range(100, 110))  # the session's other request ran to its end
