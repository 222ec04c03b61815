"""The C token relay on its own: engine frames in, the client's exact chunks out on a socket, and
everything it must leave to Python declined (pdserve.router.token_relay)."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import time

import orjson
import pytest

from pdserve.engine.model.token_bytes import TokenBytes
from pdserve.kernels.cpu import build as cpu_build
from pdserve.router import token_relay
from pdserve.router.token_relay import TokenRelay
from pdserve.v1 import engine_pb2

HEAD = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":'
TAIL = b',"finish_reason":null}]}\n\n'
# 0 "a", 1 " b", 2 and 3 the two halves of "\u65e5" (no text on their own), 4 a quote and a
# newline (JSON-escaped in the chunk), 5 a special token's nothing.
TABLE = TokenBytes([b"a", b" b", b"\xe6\x97", b"\xa5", b'"q\n', b""])

pytestmark = pytest.mark.skipif(
    not token_relay.LIBRARY.available(), reason="no C compiler: the router relays in Python"
)


@pytest.fixture
def relay() -> TokenRelay:
    made = TokenRelay.load(TABLE)
    assert made is not None
    return made


@pytest.fixture
def client():
    """(the router's end of a client connection, the client's end)."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    yield ours, theirs
    ours.close()
    theirs.close()


def _frame(*outputs: engine_pb2.EngineGenerateResponse, aborted: tuple[str, ...] = ()) -> bytes:
    return engine_pb2.SessionResponse(outputs=outputs, aborted=aborted).SerializeToString()


def _out(request_id: str, *tokens: int, **fields) -> engine_pb2.EngineGenerateResponse:
    return engine_pb2.EngineGenerateResponse(request_id=request_id, token_ids=tokens, **fields)


def _chunk(text: str) -> bytes:
    """What Python's sink writes for a plain token's text: one HTTP chunk of the event."""
    data = HEAD + orjson.dumps(text) + TAIL
    return b"%x\r\n%b\r\n" % (len(data), data)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += sock.recv(size - len(data))
    return data


def _nothing_waiting(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def _session() -> int:
    return token_relay.new_session_number()


def test_plain_tokens_go_out_as_pythons_chunks_and_come_back_on_take(relay, client):
    ours, theirs = client
    session, rid = _session(), b"req-1"
    frames = token_relay.frames()
    assert frames is not None
    assert relay.register(session, rid, ours.fileno(), HEAD, TAIL)
    started = time.perf_counter()  # the request path's clock: the relay's gaps run from it
    relay.activate(session, rid, started, 0)

    assert frames.frame(session, _frame(_out("req-1", 0))) == ([], [])
    assert frames.frame(session, _frame(_out("req-1", 1, 4))) == ([], [])  # two tokens: one chunk
    expected = _chunk("a") + _chunk(' b"q\n')
    assert _read(theirs, len(expected)) == expected

    relayed = relay.take(session, rid)
    assert relayed is not None
    assert relayed.token_ids == [0, 1, 4] and relayed.text == 'a b"q\n' and relayed.rest == b""
    assert len(relayed.gaps) == 2 and all(0 <= gap < 5 for gap in relayed.gaps)
    assert started <= relayed.last_at <= time.perf_counter()
    # take stopped the relay: the next output is Python's, and nothing more was written.
    assert frames.frame(session, _frame(_out("req-1", 0))) == ([0], [])
    assert relay.take(session, rid) is None
    relay.unregister(session, rid)
    assert _nothing_waiting(theirs)


def test_what_is_not_a_plain_token_is_declined_and_stops_the_request(relay, client):
    ours, theirs = client
    session = _session()
    frames = token_relay.frames()
    for rid in (b"r-fin", b"r-half", b"r-more-cached", b"r-idle"):
        assert relay.register(session, rid, ours.fileno(), HEAD, TAIL)
    for rid in (b"r-fin", b"r-half", b"r-more-cached"):
        relay.activate(session, rid, 1.0, 7)
    frame = _frame(
        _out("r-fin", 0, finish_reason="length"),  # a last message
        _out("r-half", 2),  # half a character: Python holds it back
        _out("r-more-cached", 0, num_cached_tokens=8),  # more cached tokens than Python saw
        _out("r-idle", 0),  # never activated
        _out("unknown", 0),  # not held at all
    )
    assert frames.frame(session, frame) == ([0, 1, 2, 3, 4], [])
    # Each declined request stays stopped: its next plain token is Python's too.
    again = _frame(_out("r-fin", 0), _out("r-half", 0), _out("r-more-cached", 0, num_cached_tokens=7))
    assert frames.frame(session, again) == ([0, 1, 2], [])
    for rid in (b"r-fin", b"r-half", b"r-more-cached", b"r-idle"):
        assert relay.take(session, rid) is None
        relay.unregister(session, rid)
    assert _nothing_waiting(theirs)


def test_a_frame_with_aborts_or_bad_bytes_is_all_pythons(relay, client):
    ours, theirs = client
    session, rid = _session(), b"req-a"
    frames = token_relay.frames()
    assert relay.register(session, rid, ours.fileno(), HEAD, TAIL)
    relay.activate(session, rid, 1.0, 0)
    assert frames.frame(session, _frame(_out("req-a", 0), aborted=("other",))) is None
    assert frames.frame(session, _frame(_out("req-a", 0))[:-1]) is None  # cut short
    assert frames.frame(session, b"\xff\xff\xff") is None
    assert _nothing_waiting(theirs)
    # Still active: none of those relayed anything, so the next plain token goes out.
    assert frames.frame(session, _frame(_out("req-a", 1))) == ([], [])
    assert _read(theirs, len(_chunk(" b"))) == _chunk(" b")
    relay.unregister(session, rid)


def test_a_request_is_held_per_session(relay, client):
    ours, theirs = client
    mine, other = _session(), _session()
    frames = token_relay.frames()
    assert relay.register(mine, b"same-id", ours.fileno(), HEAD, TAIL)
    assert not relay.register(mine, b"same-id", ours.fileno(), HEAD, TAIL)  # held already
    relay.activate(mine, b"same-id", 1.0, 0)
    assert frames.frame(other, _frame(_out("same-id", 0))) == ([0], [])
    assert _nothing_waiting(theirs)
    assert frames.frame(mine, _frame(_out("same-id", 0))) == ([], [])
    assert _read(theirs, len(_chunk("a"))) == _chunk("a")
    relay.unregister(mine, b"same-id")


def test_a_closed_descriptor_reused_by_another_connection_is_never_written(relay):
    ours, theirs = socket.socketpair()
    session = _session()
    frames = token_relay.frames()
    assert relay.register(session, b"gone", ours.fileno(), HEAD, TAIL)
    relay.activate(session, b"gone", 1.0, 0)
    number = ours.fileno()
    ours.close()  # as asyncio closes a lost connection's socket
    newcomer, newcomer_peer = socket.socketpair()
    try:
        assert number in (newcomer.fileno(), newcomer_peer.fileno())  # the number came back
        assert frames.frame(session, _frame(_out("gone", 0))) == ([], [])
        theirs.settimeout(5)
        # The chunk went to the request's own connection, held open by the relay's duplicate.
        assert _read(theirs, len(_chunk("a"))) == _chunk("a")
        assert _nothing_waiting(newcomer) and _nothing_waiting(newcomer_peer)
        relay.unregister(session, b"gone")
        assert theirs.recv(1) == b""  # and it closed with the relay's hold
    finally:
        newcomer.close()
        newcomer_peer.close()
        theirs.close()


def test_a_chunk_the_socket_takes_in_part_leaves_its_rest_for_the_transport(relay, client):
    ours, theirs = client
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    session, rid = _session(), b"req-p"
    long_head = HEAD + b" " * 300_000  # a chunk far past the socket's buffer
    frames = token_relay.frames()
    assert relay.register(session, rid, ours.fileno(), long_head, TAIL)
    relay.activate(session, rid, 1.0, 0)
    assert frames.frame(session, _frame(_out("req-p", 0))) == ([], [0])
    relayed = relay.take(session, rid)
    data = long_head + b'"a"' + TAIL
    whole = b"%x\r\n%b\r\n" % (len(data), data)
    assert relayed is not None and relayed.token_ids == [0] and relayed.text == "a"
    assert 0 < len(relayed.rest) < len(whole)
    # It stopped at the part: the request's next output is Python's, after the rest.
    assert frames.frame(session, _frame(_out("req-p", 1))) == ([0], [])
    # What went out, then the rest as the transport would write it, is the chunk.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        received = pool.submit(_read, theirs, len(whole))
        ours.sendall(relayed.rest)
        assert received.result(timeout=10) == whole
    relay.unregister(session, rid)


def test_slots_freed_in_any_order_leave_every_other_request_reachable(relay, client):
    ours, theirs = client
    session = _session()
    frames = token_relay.frames()
    ids = [f"many-{i}".encode() for i in range(3000)]
    for rid in ids:
        assert relay.register(session, rid, ours.fileno(), HEAD, TAIL)
    for rid in ids[::2]:
        relay.unregister(session, rid)
    for rid in ids[1::2]:
        relay.activate(session, rid, 1.0, 0)
    sample = ids[1::2][::97]
    frame = _frame(*(_out(rid.decode(), 0) for rid in sample), _out(ids[0].decode(), 0))
    assert frames.frame(session, frame) == ([len(sample)], [])  # only the freed one declined
    expected = _chunk("a") * len(sample)
    assert _read(theirs, len(expected)) == expected
    for rid in ids[1::2]:
        relay.unregister(session, rid)
    # Freed and held again, past the table's size in all.
    for _ in range(3):
        for rid in ids:
            assert relay.register(session, rid, ours.fileno(), HEAD, TAIL)
        for rid in ids:
            relay.unregister(session, rid)


def test_the_relay_builds_without_a_warning():
    """As the kernels (tests/kernels/cpu/test_build.py): a new warning is a failure here."""
    cc = cpu_build.compiler()
    assert cc is not None
    flags = [flag for flag in cpu_build.flags() if flag != "-shared"]
    (source,) = token_relay.LIBRARY.sources
    result = subprocess.run(
        [cc, *flags, "-Werror", "-c", str(source), "-o", os.devnull], capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
