"""UCX server bookkeeping that two-process runs hit only by timing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.connector.transports import create_transport, unavailable_reason
from pdserve.connector.transports.ucx import _Serve


class _DoneSend:
    """A ucxx send request that has completed without error."""

    completed = True

    def check_error(self) -> None:
        return None


@pytest.fixture
def closed_server() -> Any:
    reason = unavailable_reason("ucx")
    if reason is not None:
        pytest.skip(f"ucx not available: {reason}")
    server = create_transport(
        "ucx", torch.zeros((4, 2, 8)), role="producer", engine_id="prefill", track_served=True
    )
    server.close()  # its worker thread is gone: this test drives the bookkeeping itself
    return server


def test_sends_done_before_the_reader_reconnects_are_reported_served(closed_server):
    """A reader's new hello can arrive in the progress round that completed its last sends;
    dropping the old client must still report those reads served (else the lease is held)."""
    server = closed_server
    server._serves = [
        _Serve("done", "decode", 7, float("inf"), [_DoneSend()], [], report=True),
        _Serve("other", "decode", 8, float("inf"), [_DoneSend()], [], report=True),
    ]
    server._drop_client(7)
    assert [(s.transfer_id, s.reader) for s in server.poll_served()] == [
        ("done", "decode"),
        ("other", "decode"),
    ]
    assert server._serves == []
