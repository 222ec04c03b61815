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


def test_requests_and_aborts_reach_the_engine_once_and_in_order_through_flow_control():
    """The engine gets every request and abort an ``EngineSession`` sends once, in the order
    they were sent (each abort after its request): sent while the stream connects, while flow
    control holds them back (an engine not reading ~30 MB of prompts), and as it lifts."""
    from pdserve.router.engine_session import EngineSession

    sent: list[str] = []  # "g:<id>" / "a:<id>", in the order the router sent them
    received: list[str] = []
    big_prompt = list(range(1 << 18))  # ~0.8 MB a request: a few fill the socket's buffers

    async def main() -> None:
        reading = asyncio.Event()

        async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reading.wait()  # read nothing until the buffers are full
            while not received or received[-1] != "g:last":
                payload = await read_frame(reader)
                assert payload is not None
                message = engine_pb2.SessionRequest.FromString(payload)
                if message.HasField("generate"):
                    received.append(f"g:{message.generate.request_id}")
                else:
                    received.append(f"a:{message.abort_request_id}")
                await asyncio.sleep(0)
            writer.close()

        server = await asyncio.start_server(peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stub = type("NoRpc", (), {"Session": staticmethod(_rpc_unused)})()
        session = EngineSession(stub, f"127.0.0.1:{port}", lambda: port)  # type: ignore[arg-type]
        streams = []

        def generate(request_id: str, prompt: list[int]) -> None:
            request = engine_pb2.EngineGenerateRequest(request_id=request_id, prompt_token_ids=prompt)
            streams.append(session.open(request, 60))
            sent.append(f"g:{request_id}")

        def send(i: int, big: bool) -> None:
            generate(f"r{i}", big_prompt if big else [i])
            if i % 4 == 0:
                streams[i - 2].cancel()  # an abort of a request sent before
                sent.append(f"a:r{i - 2}")

        try:
            generate("r0", [1, 2, 3])  # while the stream connects: queued
            await asyncio.sleep(0.2)  # connected now
            for i in range(1, 40):  # ~30 MB the engine does not read yet: flow control pauses
                send(i, big=i % 2 == 0)
                await asyncio.sleep(0)
            # Flow control lifting: what is sent before the queued ones went out waits behind them.
            protocol = session._call.call._protocol  # type: ignore[union-attr]
            protocol.pause_writing()
            send(40, big=False)
            protocol.resume_writing()
            send(41, big=False)
            reading.set()
            for i in range(42, 400):  # more while the queued ones go out
                send(i, big=i % 10 == 0)
                await asyncio.sleep(0.0005 * (i % 3))
            generate("last", [1])
            for _ in range(600):
                if received and received[-1] == "g:last":
                    break
                await asyncio.sleep(0.05)
        finally:
            await session.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert received == sent
