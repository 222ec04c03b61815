"""The engine's Session stream, as the router uses it: many requests over one stream, each
step's outputs in one message, refusals and aborts per request, and a closed stream freeing its
requests' blocks. Both carriers: the Session RPC, and the same messages framed on plain TCP
(``pdserve.engine.session_stream``, the port ``Info`` announces), where a bad frame ends the
connection and aborts its requests. Real processes (``LocalCluster`` on the tiny model), driven
by raw clients so that what goes over the wire is what is checked; and the router's fallback to
the RPC where the framed port does not answer.
"""

from __future__ import annotations

import asyncio
import queue
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.engine.request import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.helpers.cluster import (
    LONG_ANSWER_ENGINE_ARGS,
    LONG_ANSWER_MAX_MODEL_LEN,
    is_idle,
    next_within,
    wait_idle,
)
from tests.helpers.text_corpus import prompts_of_lengths

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # Long answers (~3 s), so that a request meant to be still running is, on a loaded machine.
    with LocalCluster(1, 1, model=tiny_model_dir, engine_args=LONG_ANSWER_ENGINE_ARGS) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


class _Carrier:
    """What both test clients send: requests and aborts, as ``SessionRequest`` messages."""

    def _send(self, message: engine_pb2.SessionRequest) -> None:
        raise NotImplementedError

    def generate(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = engine_pb2.EngineGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling
        )
        self._send(engine_pb2.SessionRequest(generate=request))

    def abort(self, request_id: str) -> None:
        self._send(engine_pb2.SessionRequest(abort_request_id=request_id))


class _Session(_Carrier):
    """A Session call on one engine: ``send`` requests or aborts, iterate its messages."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outbox: queue.Queue = queue.Queue()
        self.call = engine_pb2_grpc.EngineStub(self.channel).Session(
            iter(self.outbox.get, None), timeout=TIMEOUT_S
        )
        self.messages: Iterator[engine_pb2.SessionResponse] = iter(self.call)

    def _send(self, message: engine_pb2.SessionRequest) -> None:
        self.outbox.put(message)

    def next(self) -> engine_pb2.SessionResponse:
        return next_within(self.messages, TIMEOUT_S)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


class _FramedSession(_Carrier):
    """The same, on the engine's framed Session stream: a socket, 4-byte lengths, protobuf."""

    def __init__(self, address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=TIMEOUT_S)
        assert info.session_port > 0, "the engine announces its framed Session stream"
        self.sock = socket.create_connection(
            (address.rsplit(":", 1)[0], info.session_port), timeout=TIMEOUT_S
        )

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _send(self, message: engine_pb2.SessionRequest) -> None:
        payload = message.SerializeToString()
        self.send_bytes(len(payload).to_bytes(4, "big") + payload)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError("the engine closed the stream")
            data += chunk
        return data

    def next(self) -> engine_pb2.SessionResponse:
        return engine_pb2.SessionResponse.FromString(self._read(int.from_bytes(self._read(4), "big")))

    def closed_by_engine(self) -> bool:
        """Read until the engine closes the connection (True) or nothing comes for a while."""
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


SESSIONS = {"rpc": _Session, "framed": _FramedSession}


def _collect(
    session: _Session | _FramedSession, request_ids: set[str]
) -> tuple[dict[str, list[int]], dict[str, tuple], list]:
    """Read until every request in ``request_ids`` finished or failed: {id: tokens}, {id: (code,
    message)} (of every request seen meanwhile) and the messages read."""
    tokens: dict[str, list[int]] = defaultdict(list)
    errors: dict[str, tuple] = {}
    messages = []
    finished: set[str] = set()
    while not request_ids <= finished | set(errors):
        message = session.next()
        messages.append(message)
        for output in message.outputs:
            tokens[output.request_id].extend(output.token_ids)
            if output.finish_reason:
                finished.add(output.request_id)
        for error in message.errors:
            errors[error.request_id] = (error.code, error.message)
    return tokens, errors, messages


@pytest.mark.parametrize("carrier", sorted(SESSIONS))
def test_one_session_carries_many_requests_one_message_a_step_with_generate_tokens(
    cluster, client, tiny_llm, carrier
):
    prompts = prompts_of_lengths(tiny_llm.tokenizer, [20, 37, 52, 64])
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    session = SESSIONS[carrier](cluster.decode_addresses[0])
    try:
        ids = {f"session-a-{i}" for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            session.generate(f"session-a-{i}", prompt, 12)
        tokens, errors, messages = _collect(session, ids)
    finally:
        session.close()
    assert not errors
    assert [tokens[f"session-a-{i}"] for i in range(len(prompts))] == [c.token_ids for c in expected]
    # Decode steps of the four requests together: one message carries several requests' tokens.
    assert max(len(m.outputs) for m in messages) >= 2
    assert len(messages) < sum(len(m.outputs) for m in messages)
    # The first message of each request carries the front's and the core's life-cycle events.
    firsts = {}
    for m in messages:
        for o in m.outputs:
            firsts.setdefault(o.request_id, o)
    assert all("front_received" in o.timeline for o in firsts.values())
    assert all(is_idle(s) for s in wait_idle(client))


@pytest.mark.parametrize("carrier", sorted(SESSIONS))
def test_a_session_refuses_and_aborts_each_request_on_its_own(cluster, client, tiny_llm, carrier):
    good, long = prompts_of_lengths(tiny_llm.tokenizer, [30, 40])
    session = SESSIONS[carrier](cluster.decode_addresses[0])
    try:
        session.generate("session-b-long", long, LONG_ANSWER_MAX_MODEL_LEN - len(long) - 1)
        first = session.next()  # it runs: the duplicate below meets it running
        assert {o.request_id for o in first.outputs} == {"session-b-long"} and not first.errors
        session.generate("session-b-empty", [], 4)  # no prompt
        session.generate("session-b-long", good, 4)  # an id already running there
        session.generate("session-b-good", good, 4)
        tokens, errors, _ = _collect(session, {"session-b-empty", "session-b-good"})
        tokens["session-b-long"][:0] = [t for o in first.outputs for t in o.token_ids]
        assert errors["session-b-empty"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "prompt" in errors["session-b-empty"][1]
        assert len(tokens["session-b-good"]) == 4
        # The refused duplicate did not touch the running request: it still streams, until aborted.
        assert errors["session-b-long"][0] == grpc.StatusCode.ALREADY_EXISTS.value[0]
        while len(tokens["session-b-long"]) < 8:
            message = session.next()
            assert not message.errors
            tokens["session-b-long"] += [t for o in message.outputs for t in o.token_ids]
        session.abort("session-b-long")
        assert all(is_idle(s) for s in wait_idle(client)), "the aborted request still holds blocks"
    finally:
        session.close()


def test_an_id_reused_right_after_its_abort_gets_only_the_new_requests_tokens(cluster, client, tiny_llm):
    """A router that aborts a request and at once sends a new one with the same id (a client
    retrying with its own id): the new request must get exactly its own tokens, not the old
    one's late tokens or its "abort" end, and the old one must not run on unseen."""
    old, new = prompts_of_lengths(tiny_llm.tokenizer, [35, 50])
    (expected,) = tiny_llm.generate([new], SamplingParams(max_tokens=6, ignore_eos=True))
    session = _Session(cluster.decode_addresses[0])
    try:
        for attempt in range(3):
            request_id = f"session-d-{attempt}"
            session.generate(request_id, old, 900)
            message = session.next()  # running: its tokens stream
            assert {o.request_id for o in message.outputs} == {request_id} and not message.errors
            session.abort(request_id)
            session.generate(request_id, new, 6)
            got: list[int] = []
            aborts = 0
            while True:
                message = session.next()
                assert not message.errors
                aborts += list(message.aborted).count(request_id)
                if not aborts:
                    continue  # the old request's, sent before the abort reached the engine
                # Every output of the id from the abort's answer on is the new request's.
                outputs = [o for o in message.outputs if o.request_id == request_id]
                got += [t for o in outputs for t in o.token_ids]
                if any(o.finish_reason for o in outputs):
                    assert outputs[-1].finish_reason == "length"
                    break
            assert got == expected.token_ids
        assert all(is_idle(s) for s in wait_idle(client)), "the aborted request still runs or holds blocks"
    finally:
        session.close()


def test_a_client_reusing_the_id_of_a_request_it_cancelled_gets_its_own_answer(cluster, client, tiny_llm):
    """Through the router: cancel a streaming request and send a new one with the same id at
    once. The new one is refused while the old one is still being aborted (ALREADY_EXISTS, a
    retry succeeds) or runs: either way it ends with its own tokens, not the old one's "abort"."""
    old, new = prompts_of_lengths(tiny_llm.tokenizer, [33, 47])
    (expected,) = tiny_llm.generate([new], SamplingParams(max_tokens=6, ignore_eos=True))
    for attempt in range(3):
        request_id = f"router-reuse-{attempt}"
        stream = client.stream(prompt_token_ids=old, max_tokens=900, ignore_eos=True, request_id=request_id)
        next_within(stream, TIMEOUT_S)
        next_within(stream, TIMEOUT_S)
        stream.close()  # cancels the call: the router aborts it on the engine
        for _ in range(100):
            try:
                completion = client.generate(
                    prompt_token_ids=new,
                    max_tokens=6,
                    ignore_eos=True,
                    request_id=request_id,
                    timeout=TIMEOUT_S,
                )
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
        assert (completion.token_ids, completion.finish_reason) == (expected.token_ids, "length")
    assert all(is_idle(s) for s in wait_idle(client)), "a cancelled request still runs or holds blocks"


@pytest.mark.parametrize("carrier", sorted(SESSIONS))
def test_closing_a_session_aborts_its_requests_and_frees_their_blocks(cluster, client, tiny_llm, carrier):
    prompts = prompts_of_lengths(tiny_llm.tokenizer, [45, 55, 65])
    session = SESSIONS[carrier](cluster.decode_addresses[0])
    try:
        for i, prompt in enumerate(prompts):
            session.generate(f"session-c-{i}-{carrier}", prompt, 800)
        first = session.next()
        assert first.outputs and not first.errors
    finally:
        session.close()  # the router went away with three requests running
    assert all(is_idle(s) for s in wait_idle(client)), "a closed session left blocks allocated"


def test_outputs_after_a_requests_last_one_in_the_same_batch_are_dropped_not_fatal():
    """Several core messages read at once can put a step's output after its request's final (or
    error) output, as when a client reuses the id of a request it just cancelled: the session
    sends the final one and drops the rest; it must not fail (and with it every request the
    router runs on this engine)."""
    from pdserve.engine.front_session import FrontSession
    from pdserve.engine.outputs import EngineCoreOutput
    from pdserve.engine.server import EngineServicer

    closed: list[str] = []

    class Core:
        def close_stream(self, request_id: str) -> None:
            closed.append(request_id)

    class Metrics:
        def observe_output(self, output) -> None:
            pass

    servicer = object.__new__(EngineServicer)
    servicer.core, servicer.metrics = Core(), Metrics()
    session = FrontSession()
    session.add("a")
    session.add("b")
    for output in (
        EngineCoreOutput("a", [], finish_reason="abort"),
        EngineCoreOutput("a", [7]),
        EngineCoreOutput("b", [], finish_reason="error", stop_reason="engine core died"),
        EngineCoreOutput("b", [8], finish_reason="length"),
    ):
        session.put_nowait(output)
    outputs, errors, aborted = session.take()
    response = servicer._session_response(session, outputs, errors, aborted)
    assert [(o.request_id, list(o.token_ids), o.finish_reason) for o in response.outputs] == [
        ("a", [], "abort")
    ]
    assert [(e.request_id, e.code) for e in response.errors] == [("b", grpc.StatusCode.UNAVAILABLE.value[0])]
    assert sorted(closed) == ["a", "b"] and not session.requests


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param((1 << 31).to_bytes(4, "big"), id="a-2-GB-length"),
        pytest.param(b"\x00\x00\x00\x03\xff\xff\xff", id="not-a-SessionRequest"),
    ],
)
def test_a_bad_frame_ends_that_stream_and_aborts_its_requests_only(cluster, client, tiny_llm, bad):
    prompt, other = prompts_of_lengths(tiny_llm.tokenizer, [41, 43])
    (expected,) = tiny_llm.generate([other], SamplingParams(max_tokens=5, ignore_eos=True))
    session = _FramedSession(cluster.decode_addresses[0])
    try:
        session.generate("framed-bad-long", prompt, 900)
        first = session.next()
        assert {o.request_id for o in first.outputs} == {"framed-bad-long"} and not first.errors
        session.send_bytes(bad)
        assert session.closed_by_engine(), "the engine kept a stream that sent a bad frame"
    finally:
        session.close()
    assert all(is_idle(s) for s in wait_idle(client)), (
        "the broken stream's request still runs or holds blocks"
    )
    # The engine serves the next stream as before.
    session = _FramedSession(cluster.decode_addresses[0])
    try:
        session.generate("framed-bad-next", other, 5)
        tokens, errors, _ = _collect(session, {"framed-bad-next"})
    finally:
        session.close()
    assert not errors and tokens["framed-bad-next"] == expected.token_ids


def test_the_router_falls_back_to_the_rpc_where_the_framed_port_does_not_answer():
    """An engine whose announced session port cannot be reached (a firewall, a stale Info): the
    router's session goes over the Session RPC instead, with the same requests in order."""
    from pdserve.router.engine_session import FramedSessionCall
    from pdserve.supervisor import pick_free_ports

    (closed_port,) = pick_free_ports("127.0.0.1", 1)  # free: nothing listens there
    sent: list[engine_pb2.SessionRequest] = []

    class Rpc:
        def __init__(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
            self.requests = requests

        def __aiter__(self) -> AsyncIterator[engine_pb2.SessionResponse]:
            return self._responses()

        async def _responses(self) -> AsyncIterator[engine_pb2.SessionResponse]:
            async for request in self.requests:
                sent.append(request)
                yield engine_pb2.SessionResponse(aborted=[request.abort_request_id])

        def cancel(self) -> None:
            pass

    async def requests() -> AsyncIterator[engine_pb2.SessionRequest]:
        for request_id in ("a", "b"):
            yield engine_pb2.SessionRequest(abort_request_id=request_id)

    async def run() -> list[engine_pb2.SessionResponse]:
        call = FramedSessionCall(f"127.0.0.1:{closed_port}", closed_port, requests(), Rpc)
        responses: list[engine_pb2.SessionResponse] = []
        await call.serve(responses.append)
        return responses

    responses = asyncio.run(run())
    assert [list(r.aborted) for r in responses] == [["a"], ["b"]]
    assert [r.abort_request_id for r in sent] == ["a", "b"]
