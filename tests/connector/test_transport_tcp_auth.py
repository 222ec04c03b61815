"""The tcp data port serves blocks only to readers that know the cluster token."""

from __future__ import annotations

import torch

from pdserve.connector.transports.tcp import TcpTransport


def _pair(server_token, reader_token):
    server_cache = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)
    reader_cache = torch.zeros(4, 64)
    server = TcpTransport(
        server_cache, role="producer", engine_id="prefill", token=server_token, transfer_timeout_s=5
    )
    reader = TcpTransport(
        reader_cache, role="consumer", engine_id="decode", token=reader_token, transfer_timeout_s=5
    )
    reader.add_remote("prefill", server.local_metadata())
    return server, reader, server_cache, reader_cache


def _read(reader) -> list:
    reader.start_read("t1", "prefill", [2, 3], [0, 1])
    return reader.wait(10)


def test_reader_with_the_token_gets_the_blocks():
    server, reader, server_cache, reader_cache = _pair("s3cret", "s3cret")
    with server, reader:
        (result,) = _read(reader)
        assert result.ok, result.error
        assert torch.equal(reader_cache[:2], server_cache[2:])


def test_reader_with_a_wrong_or_missing_token_gets_nothing():
    for reader_token in ("wrong", None):
        server, reader, _, reader_cache = _pair("s3cret", reader_token)
        with server, reader:
            (result,) = _read(reader)
            assert not result.ok
            assert "authentication" in result.error or "refused" in result.error
            assert torch.count_nonzero(reader_cache) == 0
