"""No code-executing formats on the wire, loopback binds by default, authenticated side channel."""

from __future__ import annotations

import pathlib
import re

import msgpack
import pytest
import zmq

from pdserve.connector.side_channel import SideChannelClient, SideChannelError, SideChannelServer, pack

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pdserve"
FORBIDDEN = re.compile(
    r"\bimport pickle\b|\bfrom pickle\b|\bcPickle\b|\bdill\b|\bcloudpickle\b|recv_pyobj|send_pyobj"
    r"|(?<![.\w])eval\(|(?<![.\w])exec\(|torch\.load\(|marshal\.loads"
)


def test_no_pickle_or_eval_anywhere_in_the_package():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "/v1/" not in str(path)  # generated protobuf code
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert offenders == []


def test_every_server_binds_loopback_by_default():
    from pdserve.cli import build_parser
    from pdserve.config import KVTransferConfig

    parser = build_parser()
    for command in ("prefill", "decode"):
        args = parser.parse_args([command, "--port", "1"])
        assert args.host == "127.0.0.1", command
    assert parser.parse_args(["router", "--port", "1", "--decode", "x:1"]).host == "127.0.0.1"
    assert KVTransferConfig().host == "127.0.0.1"


@pytest.fixture
def side_channel():
    calls: list[dict] = []
    server = SideChannelServer(
        "127.0.0.1", 0, {"release": lambda m: calls.append(m) or {"ok": True}}, token="s3cret"
    )
    yield server, calls
    server.close()


def test_side_channel_server_sleeps_until_a_message_and_stops_on_close():
    """Its thread waits for a message with no timeout (an idle prefill engine wakes for
    nothing); ``close`` wakes it, the thread ends and the port is free again."""
    server = SideChannelServer("127.0.0.1", 0, {"release": lambda m: {"ok": True}})
    client = SideChannelClient("127.0.0.1", server.port)
    assert client.request({"type": "release", "request_ids": ["a"]}, timeout_s=2)["ok"]
    client.close()
    server.close()
    assert not server._thread.is_alive()
    server.close()  # a second close is harmless
    again = SideChannelServer("127.0.0.1", server.port, {})
    again.close()


def test_side_channel_refuses_peers_without_the_cluster_token(side_channel):
    server, calls = side_channel
    for token in (None, "wrong"):
        client = SideChannelClient("127.0.0.1", server.port, token=token)
        with pytest.raises(SideChannelError):
            client.request({"type": "release", "request_ids": ["a"]}, timeout_s=2)
        client.close()
    assert calls == []
    good = SideChannelClient("127.0.0.1", server.port, token="s3cret")
    assert good.request({"type": "release", "request_ids": ["a"]}, timeout_s=2)["ok"]
    good.close()
    assert [c["request_ids"] for c in calls] == [["a"]]


@pytest.mark.parametrize(
    "frames",
    [
        [b""],
        [b"\xff\xfe garbage", b""],
        [msgpack.packb([1, 2, 3]), b""],
        [msgpack.packb({"type": 7}), b""],
        [b"\x80" * 10_000, b"x" * 32],
        pack({"type": "release", "request_ids": ["a"]}, token="s3cret")[:1],  # MAC frame missing
    ],
    ids=["empty", "not-msgpack", "not-a-map", "bad-type", "big-garbage", "no-mac"],
)
def test_side_channel_survives_malformed_frames(side_channel, frames):
    server, calls = side_channel
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    raw.send_multipart(frames)
    assert raw.poll(2000), "the server did not answer a malformed frame"
    reply = msgpack.unpackb(raw.recv_multipart()[0])
    assert reply["ok"] is False and reply["error"]
    raw.close()
    # Still serving.
    good = SideChannelClient("127.0.0.1", server.port, token="s3cret")
    assert good.request({"type": "release", "request_ids": ["b"]}, timeout_s=2)["ok"]
    good.close()
    assert [c["request_ids"] for c in calls] == [["b"]]
