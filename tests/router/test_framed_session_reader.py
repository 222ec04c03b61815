"""The router's reader of an engine's framed Session stream (``FramedSessionCall``), against a
real socket whose far end writes frames cut at arbitrary bytes: every response reaches the
handler once and in order, the requests go out framed, and a cut or oversized frame fails the
call UNAVAILABLE as a broken RPC would."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from pdserve.router.engine_session import FramedSessionCall
from pdserve.session_frames import HEADER_BYTES, MAX_FRAME_BYTES, frame, payload_length
from pdserve.v1 import engine_pb2

Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload, as an engine reads a router's requests; None at a clean end."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    return await reader.readexactly(payload_length(header))


def _responses(count: int) -> list[engine_pb2.SessionResponse]:
    return [
        engine_pb2.SessionResponse(
            outputs=[engine_pb2.EngineGenerateResponse(request_id=f"r{i % 3}", token_ids=list(range(i % 5)))],
            aborted=[f"a{i}"] * (i % 2),
        )
        for i in range(count)
    ]


async def _no_requests() -> AsyncIterator[engine_pb2.SessionRequest]:
    await asyncio.Event().wait()  # none, until cancelled
    yield engine_pb2.SessionRequest()


def _rpc_unused(requests: object) -> object:
    raise AssertionError("the framed port answers: no RPC")


async def _serve_against(
    peer: Peer,
    handle: Callable[[engine_pb2.SessionResponse], None],
    requests: AsyncIterator[engine_pb2.SessionRequest] | None = None,
) -> None:
    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        call = FramedSessionCall(f"127.0.0.1:{port}", port, requests or _no_requests(), _rpc_unused)
        await asyncio.wait_for(call.serve(handle), 30)
    finally:
        server.close()
        await server.wait_closed()


def test_frames_cut_at_any_byte_reach_the_handler_in_order():
    expected = _responses(200)
    data = b"".join(frame(r.SerializeToString()) for r in expected)
    rng = random.Random(0)

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        at = 0
        while at < len(data):
            size = rng.choice([1, 2, 3, 5, 7, 64, 4096])
            writer.write(data[at : at + size])
            at += size
            await writer.drain()
            if rng.random() < 0.3:
                await asyncio.sleep(0.001)  # apart, as steps are; else several in one read
        writer.close()

    got: list[engine_pb2.SessionResponse] = []
    asyncio.run(_serve_against(peer, got.append))
    assert got == expected


def test_requests_go_out_framed_and_answers_come_back():
    async def requests() -> AsyncIterator[engine_pb2.SessionRequest]:
        for request_id in ("x", "y", "z"):
            yield engine_pb2.SessionRequest(abort_request_id=request_id)
        await asyncio.Event().wait()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            payload = await read_frame(reader)
            assert payload is not None
            request = engine_pb2.SessionRequest.FromString(payload)
            writer.write(
                frame(engine_pb2.SessionResponse(aborted=[request.abort_request_id]).SerializeToString())
            )
        await writer.drain()
        writer.close()

    got: list[engine_pb2.SessionResponse] = []
    asyncio.run(_serve_against(peer, got.append, requests()))
    assert [list(r.aborted) for r in got] == [["x"], ["y"], ["z"]]


@pytest.mark.parametrize("cut", ["inside a frame", "oversized frame"])
def test_a_cut_or_oversized_frame_fails_the_call_unavailable(cut):
    whole = frame(_responses(1)[0].SerializeToString())
    if cut == "inside a frame":
        data = whole + whole[:-2]
    else:
        data = whole + (MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"\0" * 16

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if cut == "oversized frame":
            await reader.read()  # the router hangs up
        writer.close()

    got: list[engine_pb2.SessionResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        asyncio.run(_serve_against(peer, got.append))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(got) == 1  # the whole frame before the bad one was handled


def test_what_the_handler_raises_ends_the_call_and_is_raised():
    data = b"".join(frame(r.SerializeToString()) for r in _responses(5))

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        await reader.read()  # until the router hangs up
        writer.close()

    got: list[engine_pb2.SessionResponse] = []

    def handle(response: engine_pb2.SessionResponse) -> None:
        got.append(response)
        if len(got) == 2:
            raise ValueError("a bug in the handler")

    with pytest.raises(ValueError, match="a bug in the handler"):
        asyncio.run(_serve_against(peer, handle))
    assert len(got) == 2  # nothing after the failure
