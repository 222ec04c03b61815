"""The core's side of a framed session (``pdserve.engine.core_sessions``), on real sockets: the
socket handed over ``SCM_RIGHTS``, one frame per step, errors and abort acknowledgements in
order, an id reused after its abort, the front told only of each request's end, and a router
that reads slowly getting every byte in order once it reads again."""

from __future__ import annotations

import socket

import pytest

from pdserve.engine.core_sessions import CoreSessions, send_session_socket
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.session_frames import HEADER_BYTES
from pdserve.v1 import engine_pb2


@pytest.fixture
def wired():
    """(the core's sessions with session 1 handed over, the router's end of that session)."""
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    router, engine = socket.socketpair()
    sessions = CoreSessions(core_end)
    send_session_socket(front_end, 1, engine)
    engine.close()  # the front's copy: the core's is the one that writes
    yield sessions, router
    sessions.close_all()
    for s in (front_end, core_end, router):
        s.close()


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


def test_a_step_of_session_requests_is_one_frame_and_the_front_gets_only_their_ends(wired):
    sessions, router = wired
    assert sessions.bind("a", 1, {"front_received": 1.5})
    assert sessions.bind("b", 1, None)
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
    assert [(o.request_id, o.new_token_ids, o.streamed_tokens, o.finish_reason) for o in front] == [
        ("a", [], 2, "length")
    ]
    first, second = read_frames(router)
    assert [(o.request_id, list(o.token_ids)) for o in first.outputs] == [("a", [5]), ("b", [6])]
    assert dict(first.outputs[0].timeline) == {"front_received": 1.5, "scheduled": 2.0}
    assert [(o.request_id, list(o.token_ids), o.finish_reason) for o in second.outputs] == [
        ("a", [8], "length"),
        ("b", [9], ""),
    ]
    assert not second.outputs[0].timeline  # the front's events go with the first output only


def test_errors_refusals_and_abort_acknowledgements_reach_the_session_in_order(wired):
    sessions, router = wired
    sessions.bind("bad", 1, None)
    sessions.bind("x", 1, None)
    sessions.refuse(1, ["dup"], [6], ["request_id 'dup' is already running"])
    front = step(sessions, [EngineCoreOutput("bad", [], finish_reason="error", stop_reason="kv_load_failed")])
    assert [(o.request_id, o.finish_reason) for o in front] == [("bad", "error")]
    sessions.expect_abort(["x", "gone"], 1)
    front = step(
        sessions,
        [
            EngineCoreOutput("x", [], finish_reason="abort", answers_abort=True),
            EngineCoreOutput("gone", [], answers_abort=True),  # it had ended: answered all the same
        ],
    )
    assert [o.request_id for o in front] == ["x", "gone"]  # the front counts its aborts' answers
    refused, failed, acknowledged = read_frames(router)
    assert [(e.request_id, e.code) for e in refused.errors] == [("dup", 6)]
    assert [(e.request_id, e.code) for e in failed.errors] == [("bad", 10)]  # ABORTED: KV lost
    assert list(acknowledged.aborted) == ["x", "gone"] and not acknowledged.outputs


def test_an_id_reused_after_its_abort_writes_the_new_requests_outputs(wired):
    """The new request is bound on input, before the old one's abort is answered (after the
    step in flight): the old one's outputs are still its own, the new one's follow."""
    sessions, router = wired
    sessions.bind("r", 1, None)
    step(sessions, [EngineCoreOutput("r", [1])])
    sessions.expect_abort(["r"], 1)
    sessions.bind("r", 1, {"front_received": 9.0})
    step(
        sessions,
        [EngineCoreOutput("r", [2]), EngineCoreOutput("r", [], finish_reason="abort", answers_abort=True)],
    )
    step(sessions, [EngineCoreOutput("r", [3])])
    frames = read_frames(router)
    assert [list(o.token_ids) for f in frames for o in f.outputs] == [[1], [2], [3]]
    assert list(frames[1].aborted) == ["r"]
    assert dict(frames[2].outputs[0].timeline) == {"front_received": 9.0}  # the new request's first


def test_a_router_that_stops_reading_gets_every_frame_in_order_when_it_reads_again(wired):
    sessions, router = wired
    router.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sessions.bind("long", 1, None)
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


def test_a_router_gone_drops_its_session_and_later_outputs_still_end_at_the_front(wired):
    sessions, router = wired
    sessions.bind("q", 1, None)
    router.close()
    step(sessions, [EngineCoreOutput("q", [1])])
    step(sessions, [EngineCoreOutput("q", [2])])  # the write fails: the session is dropped
    front = step(sessions, [EngineCoreOutput("q", [3], finish_reason="length")])
    assert [(o.request_id, o.streamed_tokens) for o in front] == [("q", 3)]
    assert not sessions.waiting_to_write()


def test_the_channel_closed_by_a_dead_front_is_told_apart_from_an_empty_one():
    front_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sessions = CoreSessions(core_end)
    assert sessions.accept()  # nothing sent yet: the front is still there
    front_end.close()
    assert not sessions.accept()
    core_end.close()
