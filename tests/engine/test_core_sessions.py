"""The core's side of a framed session (``pdserve.engine.core_sessions``), on real sockets: the
socket handed over ``SCM_RIGHTS``, the router's requests and aborts read in order, refusals,
one frame per step, errors and abort acknowledgements in order, an id reused after its abort, a
router that leaves (or breaks the stream) having its requests aborted, a drain closing idle
sessions, and a router that reads slowly getting every byte in order once it reads again."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from pdserve.engine.core import AbortRequests, EngineCoreRequest
from pdserve.engine.core_sessions import CoreSessions
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.session_stream import hand_over
from pdserve.session_frames import HEADER_BYTES, frame
from pdserve.v1 import common_pb2, engine_pb2


@pytest.fixture
def wired():
    """(the core's sessions with session 1 handed over, the router's end of that session)."""
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    router, engine = socket.socketpair()
    sessions = CoreSessions(core_end)
    hand_over(front_end, 1, engine)
    engine.close()  # the front's copy: the core's is the only one
    assert sessions.accept()
    yield sessions, router
    sessions.close_all()
    for s in (front_end, core_end, router):
        s.close()


def session_fd(sessions: CoreSessions) -> int:
    (fd,) = sessions.readable()
    return fd


def send(router: socket.socket, *messages: engine_pb2.SessionRequest) -> None:
    router.sendall(b"".join(frame(m.SerializeToString()) for m in messages))


def generate(request_id: str, prompt: list[int], **sampling) -> engine_pb2.SessionRequest:
    request = engine_pb2.EngineGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )
    return engine_pb2.SessionRequest(generate=request)


def abort(request_id: str) -> engine_pb2.SessionRequest:
    return engine_pb2.SessionRequest(abort_request_id=request_id)


def read_inputs(sessions: CoreSessions, wait_s: float = 5.0) -> list:
    """What the session sent, as the core's loop takes it (waiting for the bytes to arrive)."""
    deadline = time.monotonic() + wait_s
    inputs: list = []
    while not inputs and time.monotonic() < deadline:
        inputs = sessions.read(session_fd(sessions)) if sessions.readable() else []
        time.sleep(0.01)
    return inputs


def read_all(router: socket.socket, first_wait: float = 5.0) -> bytes:
    """What the router can read now (waiting up to ``first_wait`` s for the first bytes)."""
    router.settimeout(first_wait)
    data = bytearray()
    try:
        while chunk := router.recv(1 << 16):
            data += chunk
            router.settimeout(0.2)
    except TimeoutError:
        pass
    return bytes(data)


def parse_frames(data: bytes) -> list[engine_pb2.SessionResponse]:
    frames = []
    while data:
        length = int.from_bytes(data[:HEADER_BYTES], "big")
        assert len(data) >= HEADER_BYTES + length, "a frame cut short"
        frames.append(engine_pb2.SessionResponse.FromString(data[HEADER_BYTES : HEADER_BYTES + length]))
        data = data[HEADER_BYTES + length :]
    return frames


def read_frames(router: socket.socket) -> list[engine_pb2.SessionResponse]:
    return parse_frames(read_all(router))


def step(sessions: CoreSessions, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    front = sessions.route(outputs)
    sessions.flush_messages()
    return front


def test_requests_read_in_order_and_a_step_is_one_frame_the_front_gets_none_of(wired):
    sessions, router = wired
    send(router, generate("a", [1, 2, 3], max_tokens=4, seed=7), generate("b", [4], ignore_eos=True))
    a, b = read_inputs(sessions)
    assert isinstance(a, EngineCoreRequest) and isinstance(b, EngineCoreRequest)
    assert (a.request_id, a.prompt_token_ids, a.sampling_params.max_tokens, a.sampling_params.seed) == (
        "a",
        [1, 2, 3],
        4,
        7,
    )
    assert (b.request_id, b.sampling_params.ignore_eos) == ("b", True)
    front = step(
        sessions,
        [
            EngineCoreOutput("a", [5], timeline={"scheduled": 2.0}),
            EngineCoreOutput("b", [6]),
            EngineCoreOutput("other", [7]),  # not a session request: the front's
        ],
    )
    assert [o.request_id for o in front] == ["other"]
    front = step(sessions, [EngineCoreOutput("a", [8], finish_reason="length"), EngineCoreOutput("b", [9])])
    assert front == []  # a session request's end too: the front is off the request path
    first, second = read_frames(router)
    assert [(o.request_id, list(o.token_ids)) for o in first.outputs] == [("a", [5]), ("b", [6])]
    timeline = dict(first.outputs[0].timeline)
    assert timeline["scheduled"] == 2.0 and abs(timeline["front_received"] - time.time()) < 60
    assert [(o.request_id, list(o.token_ids), o.finish_reason) for o in second.outputs] == [
        ("a", [8], "length"),
        ("b", [9], ""),
    ]
    assert not second.outputs[0].timeline  # the engine's receive event goes with the first output only


def test_refusals_errors_and_abort_acknowledgements_reach_the_session_in_order(wired):
    sessions, router = wired
    send(router, generate("x", [1]), generate("bad", [2]))
    assert [i.request_id for i in read_inputs(sessions)] == ["x", "bad"]
    send(
        router,
        generate("x", [3]),  # x runs: a second x is refused, and does not touch the first
        generate("neg", [4], temperature=-1.0),  # refused before it reaches the core
    )
    assert read_inputs(sessions, wait_s=0.5) == []
    refused = read_frames(router)
    assert [(e.request_id, e.code) for f in refused for e in f.errors] == [
        ("x", grpc.StatusCode.ALREADY_EXISTS.value[0]),
        ("neg", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
    ]
    assert "temperature" in refused[-1].errors[-1].message
    front = step(sessions, [EngineCoreOutput("bad", [], finish_reason="error", stop_reason="kv_load_failed")])
    assert front == []
    send(router, abort("x"), abort("gone"))
    inputs = read_inputs(sessions)
    assert [type(i) for i in inputs] == [AbortRequests, AbortRequests]
    assert [i.request_ids for i in inputs] == [["x"], ["gone"]]
    front = step(
        sessions,
        [
            EngineCoreOutput("x", [], finish_reason="abort", answers_abort=True),
            EngineCoreOutput("gone", [], answers_abort=True),  # it had ended: answered all the same
        ],
    )
    assert front == []  # the session's aborts, answered to the session only
    failed, acknowledged = read_frames(router)
    assert [(e.request_id, e.code) for e in failed.errors] == [("bad", 10)]  # ABORTED: KV lost
    assert list(acknowledged.aborted) == ["x", "gone"] and not acknowledged.outputs


def test_an_id_reused_after_its_abort_is_taken_and_gets_the_new_requests_outputs(wired):
    """The new request is taken on input, before the old one's abort is answered (after the
    step in flight): the old one's outputs are still its own, the new one's follow."""
    sessions, router = wired
    send(router, generate("r", [1]))
    read_inputs(sessions)
    step(sessions, [EngineCoreOutput("r", [1])])
    send(router, abort("r"), generate("r", [2]))
    taken = read_inputs(sessions)
    assert [type(i) for i in taken] == [AbortRequests, EngineCoreRequest]
    step(
        sessions,
        [EngineCoreOutput("r", [2]), EngineCoreOutput("r", [], finish_reason="abort", answers_abort=True)],
    )
    step(sessions, [EngineCoreOutput("r", [3])])
    frames = read_frames(router)
    assert not any(f.errors for f in frames)
    assert [list(o.token_ids) for f in frames for o in f.outputs] == [[1], [2], [3]]
    assert list(frames[1].aborted) == ["r"]
    assert "front_received" in frames[2].outputs[0].timeline  # the new request's first output


def test_a_router_that_stops_reading_gets_every_frame_in_order_when_it_reads_again(wired):
    sessions, router = wired
    router.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    send(router, generate("long", [1]))
    read_inputs(sessions)
    for i in range(3000):  # far more than the socket buffers hold
        step(sessions, [EngineCoreOutput("long", list(range(i, i + 40)))])
    assert sessions.waiting_to_write(), "the kernel took it all: the test proves nothing"
    data = bytearray()
    router.settimeout(5.0)
    while sessions.waiting_to_write():
        data += router.recv(1 << 16)
        sessions.flush_pending()
    data += read_all(router, first_wait=0.5)
    got = parse_frames(bytes(data))
    assert [o.token_ids[0] for f in got for o in f.outputs] == list(range(3000))


def test_a_router_that_leaves_has_its_running_requests_aborted(wired):
    sessions, router = wired
    send(router, generate("done", [1]), generate("q", [2]), generate("aborting", [3]))
    read_inputs(sessions)
    step(sessions, [EngineCoreOutput("done", [5], finish_reason="length")])
    send(router, abort("aborting"))
    assert [i.request_ids for i in read_inputs(sessions)] == [["aborting"]]
    router.close()
    (ended,) = read_inputs(sessions)
    # Not the finished one, nor the one whose abort is on its way already.
    assert isinstance(ended, AbortRequests) and ended.request_ids == ["q"]
    assert sessions.readable() == []
    front = step(sessions, [EngineCoreOutput("q", [], finish_reason="abort", answers_abort=True)])
    assert [o.request_id for o in front] == ["q"]  # the core's own abort: no session asked for it


def test_a_write_to_a_router_gone_aborts_its_requests_at_the_next_input(wired):
    sessions, router = wired
    send(router, generate("q", [1]))
    read_inputs(sessions)
    router.close()
    for i in range(20):  # the first writes may still succeed; a later one fails
        step(sessions, [EngineCoreOutput("q", [i])])
        lost = sessions.take_lost()
        if lost:
            break
    assert [a.request_ids for a in lost] == [["q"]]
    assert not sessions.waiting_to_write() and sessions.readable() == []


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param((1 << 31).to_bytes(4, "big"), id="a-2-GB-length"),
        pytest.param(b"\x00\x00\x00\x03\xff\xff\xff", id="not-a-SessionRequest"),
    ],
)
def test_a_bad_frame_drops_the_session_and_aborts_its_requests(wired, bad):
    sessions, router = wired
    send(router, generate("q", [1]))
    read_inputs(sessions)
    router.sendall(bad)
    (ended,) = read_inputs(sessions)
    assert isinstance(ended, AbortRequests) and ended.request_ids == ["q"]
    assert read_all(router, first_wait=1.0) == b"", "the engine kept a stream that sent a bad frame"


def test_a_drain_refuses_new_requests_and_closes_each_session_once_idle(wired):
    sessions, router = wired
    send(router, generate("q", [1]))
    read_inputs(sessions)
    sessions.start_draining("decode engine e:1 is draining")
    send(router, generate("late", [2]))
    assert read_inputs(sessions, wait_s=0.5) == []
    step(sessions, [EngineCoreOutput("q", [7], finish_reason="stop")])
    data = read_all(router)
    refused, last = parse_frames(data)
    assert [(e.request_id, e.code, e.message) for e in refused.errors] == [
        ("late", grpc.StatusCode.UNAVAILABLE.value[0], "decode engine e:1 is draining")
    ]
    assert [(o.request_id, o.finish_reason) for o in last.outputs] == [("q", "stop")]
    assert sessions.readable() == [], "the drained session stayed open"
    router.settimeout(1.0)
    assert router.recv(1) == b""  # the router sees the end: it goes elsewhere


def test_the_channel_closed_by_a_dead_front_is_told_apart_from_an_empty_one():
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sessions = CoreSessions(core_end)
    assert sessions.accept()  # nothing sent yet: the front is still there
    front_end.close()
    assert not sessions.accept()
    core_end.close()
