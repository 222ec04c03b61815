"""The transport interface's contract, checked in one process over TCP (fast, no extras needed).

What crosses processes (and every transport) is in ``test_transport_two_process.py``.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from pdserve.connector.transports import (
    BlockRun,
    TransferState,
    available_transports,
    coalesce_runs,
    create_transport,
)
from pdserve.connector.transports.tcp import TcpFault
from pdserve.engine.kv_layout import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
NUM_BLOCKS = 16


def _cache(seed: int | None = None) -> torch.Tensor:
    if seed is None:
        return SPEC.allocate(NUM_BLOCKS)
    g = torch.Generator().manual_seed(seed)
    return torch.rand((NUM_BLOCKS, *SPEC.block_shape), generator=g)


@pytest.fixture
def pair():
    """A serving and a reading TCP transport in this process, the reader knowing the server."""
    server = create_transport(
        "tcp", _cache(seed=1), role="producer", engine_id="prefill", spec=SPEC, track_served=True
    )
    reader = create_transport(
        "tcp", _cache(), role="consumer", engine_id="decode", spec=SPEC, transfer_timeout_s=5
    )
    reader.add_remote("prefill", server.local_metadata())
    yield server, reader
    reader.close()
    server.close()


# ---------------------------------------------------------------------- block runs


def test_coalesce_merges_runs_contiguous_on_both_sides_only():
    assert coalesce_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [
        BlockRun(4, 0, 3),
        BlockRun(9, 3, 1),
        BlockRun(10, 7, 1),
    ]
    assert coalesce_runs([3, 2, 1], [0, 1, 2]) == [BlockRun(3, 0, 1), BlockRun(2, 1, 1), BlockRun(1, 2, 1)]
    assert coalesce_runs(list(range(100)), list(range(7, 107))) == [BlockRun(0, 7, 100)]
    assert coalesce_runs([], []) == []


def test_coalesce_rejects_lists_of_different_lengths():
    with pytest.raises(ValueError, match="remote_block_ids has 2 blocks"):
        coalesce_runs([1, 2], [1])


# ---------------------------------------------------------------------- registry


def test_tcp_is_always_available_and_unknown_names_are_refused():
    assert "tcp" in available_transports()
    with pytest.raises(ValueError, match="unknown transport"):
        create_transport("carrier-pigeon", _cache())


def test_auto_picks_an_available_transport():
    transport = create_transport("auto", _cache(), role="consumer")
    try:
        assert transport.name in available_transports()
    finally:
        transport.close()


def test_cache_not_matching_the_spec_is_refused():
    wrong = torch.zeros((NUM_BLOCKS, 3, 2, 4, 2, 16))
    with pytest.raises(ValueError, match="does not match the KV spec"):
        create_transport("tcp", wrong, spec=SPEC)
    with pytest.raises(ValueError, match="contiguous"):
        create_transport("tcp", _cache().transpose(0, 1), role="consumer")


# ---------------------------------------------------------------------- reads


def test_read_moves_exact_bytes_and_reports_once(pair):
    server, reader = pair
    reader.start_read("r1", "prefill", [3, 4, 5, 0, 15], [10, 11, 12, 2, 0])
    assert reader.state("r1") in (TransferState.TRANSFERRING, TransferState.SUCCESS)
    results = reader.wait(5.0)
    assert [(r.transfer_id, r.ok, r.state) for r in results] == [("r1", True, TransferState.SUCCESS)]
    assert results[0].nbytes == 5 * reader.bytes_per_block
    assert torch.equal(reader.kv_cache[[10, 11, 12, 2, 0]], server.kv_cache[[3, 4, 5, 0, 15]])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 11, 12, 2, 0)]
    assert not reader.kv_cache[untouched].any()
    assert reader.poll() == []  # reported once
    assert reader.state("r1") is None
    deadline = time.time() + 5
    served = []
    while not served and time.time() < deadline:
        served = server.poll_served()
        time.sleep(0.01)
    assert [(s.transfer_id, s.reader) for s in served] == [("r1", "decode")]


def test_a_producer_built_as_the_engines_build_it_keeps_no_served_reads():
    """The engines free blocks on the side channel's release, never on ``poll_served``: a
    serving transport keeps served reads only when asked to, else one entry a request would
    pile up for as long as the engine runs."""
    server = create_transport("tcp", _cache(seed=1), role="producer", engine_id="prefill", spec=SPEC)
    reader = create_transport(
        "tcp", _cache(), role="consumer", engine_id="decode", spec=SPEC, transfer_timeout_s=5
    )
    try:
        reader.add_remote("prefill", server.local_metadata())
        for i in range(3):
            reader.start_read(f"r{i}", "prefill", [i, 8 + i], [2 * i, 2 * i + 1])
        results = []
        deadline = time.time() + 10
        while len(results) < 3 and time.time() < deadline:
            results += reader.wait(1.0)
        assert sorted((r.transfer_id, r.ok) for r in results) == [("r0", True), ("r1", True), ("r2", True)]
        assert torch.equal(reader.kv_cache[[0, 1, 2, 3, 4, 5]], server.kv_cache[[0, 8, 1, 9, 2, 10]])
        with pytest.raises(RuntimeError, match="track_served=True"):
            server.poll_served()
        assert not server._served
    finally:
        reader.close()
        server.close()


def test_many_reads_in_flight_all_complete(pair):
    server, reader = pair
    for i in range(8):
        reader.start_read(f"r{i}", "prefill", [i, i + 8], [2 * i, 2 * i + 1])
    results = []
    deadline = time.time() + 10
    while len(results) < 8 and time.time() < deadline:
        results += reader.wait(1.0)
    assert sorted(r.transfer_id for r in results) == [f"r{i}" for i in range(8)]
    assert all(r.ok for r in results)
    expected = server.kv_cache[[b for i in range(8) for b in (i, i + 8)]]
    assert torch.equal(reader.kv_cache, expected)


def test_zero_block_read_succeeds_at_once(pair):
    _, reader = pair
    reader.start_read("empty", "prefill", [], [])
    [result] = reader.poll()
    assert result.ok and result.nbytes == 0


@pytest.mark.parametrize(
    ("remote", "local", "match"),
    [
        ([1, 2], [1], "remote_block_ids has 2 blocks"),
        ([1], [NUM_BLOCKS], "local_block_ids out of range"),
        ([NUM_BLOCKS], [1], "remote_block_ids out of range"),
        ([-1], [1], "remote_block_ids out of range"),
        ([1, 2], [3, 3], "duplicates"),
        ([1.5], [1], "must hold ints"),
        ([True], [1], "must hold ints"),
    ],
)
def test_bad_block_ids_are_a_clear_error(pair, remote, local, match):
    _, reader = pair
    with pytest.raises(ValueError, match=match):
        reader.start_read("bad", "prefill", remote, local)
    assert reader.num_in_flight == 0


def test_unknown_peer_and_duplicate_transfer_id_are_refused(pair):
    _, reader = pair
    with pytest.raises(ValueError, match="unknown remote engine"):
        reader.start_read("x", "nobody", [1], [1])
    reader.start_read("dup", "prefill", [1], [1])
    if reader.state("dup") is TransferState.TRANSFERRING:
        with pytest.raises(ValueError, match="already in flight"):
            reader.start_read("dup", "prefill", [2], [2])
    assert [r.ok for r in reader.wait(5.0)] == [True]


def test_peer_with_another_layout_or_transport_is_refused(pair):
    server, reader = pair
    meta = server.local_metadata()
    with pytest.raises(ValueError, match="KV layouts differ"):
        reader.add_remote("other", {**meta, "bytes_per_block": meta["bytes_per_block"] * 2})
    with pytest.raises(ValueError, match="speaks 'ucx'"):
        reader.add_remote("other", {**meta, "transport": "ucx"})
    with pytest.raises(ValueError, match="does not serve tcp reads"):
        reader.add_remote("other", {k: v for k, v in meta.items() if k != "port"})


def test_repeated_handshake_keeps_reads_in_flight_but_a_restarted_peer_replaces_them():
    server = create_transport(
        "tcp", _cache(seed=1), role="producer", fault=TcpFault(after_bytes=10, stall_s=0.3)
    )
    reader = create_transport("tcp", _cache(), role="consumer", transfer_timeout_s=5)
    try:
        reader.add_remote("prefill", server.local_metadata())
        reader.start_read("slow", "prefill", [1], [1])
        time.sleep(0.05)
        reader.add_remote("prefill", dict(server.local_metadata()))  # same peer, same metadata
        [result] = reader.wait(5.0)
        assert result.ok, result.error
        reader.start_read("doomed", "prefill", [2], [2])
        time.sleep(0.05)
        reader.add_remote("prefill", {**server.local_metadata(), "engine_id": "prefill-restarted"})
        [result] = reader.wait(5.0)
        assert not result.ok and result.error == "peer replaced"
    finally:
        reader.close()
        server.close()


def test_server_refuses_blocks_it_does_not_have():
    server = create_transport("tcp", _cache(seed=1), role="producer", engine_id="prefill")
    reader = create_transport("tcp", _cache(), role="consumer", transfer_timeout_s=5)
    try:
        # A peer that claims more blocks than it has: the server is the last line of defence.
        reader.add_remote("prefill", {**server.local_metadata(), "num_blocks": 10 * NUM_BLOCKS})
        reader.start_read("far", "prefill", [NUM_BLOCKS + 3], [0])
        [result] = reader.wait(5.0)
        assert not result.ok and "outside blocks" in result.error
        reader.start_read("near", "prefill", [3], [0])  # the connection is still usable
        assert [r.ok for r in reader.wait(5.0)] == [True]
    finally:
        reader.close()
        server.close()


def test_stalled_server_fails_the_read_at_its_deadline_then_recovers():
    server = create_transport(
        "tcp", _cache(seed=1), role="producer", engine_id="prefill", fault=TcpFault(after_bytes=100, times=1)
    )
    reader = create_transport("tcp", _cache(), role="consumer", transfer_timeout_s=30)
    try:
        reader.add_remote("prefill", server.local_metadata())
        start = time.perf_counter()
        reader.start_read("stuck", "prefill", [1, 2], [1, 2], timeout_s=0.5)
        [result] = reader.wait(10.0)
        elapsed = time.perf_counter() - start
        assert not result.ok and "timed out" in result.error
        assert 0.45 <= elapsed < 2.0
        reader.start_read("after", "prefill", [1, 2], [1, 2])
        [result] = reader.wait(5.0)
        assert result.ok
        assert torch.equal(reader.kv_cache[[1, 2]], server.kv_cache[[1, 2]])
    finally:
        reader.close()
        server.close()


def test_close_fails_reads_in_flight_promptly():
    server = create_transport("tcp", _cache(seed=1), role="producer", fault=TcpFault(after_bytes=0))
    reader = create_transport("tcp", _cache(), role="consumer", transfer_timeout_s=60)
    reader.add_remote("prefill", server.local_metadata())
    reader.start_read("doomed", "prefill", [1], [1])
    time.sleep(0.1)
    start = time.perf_counter()
    reader.close()
    assert time.perf_counter() - start < 2.0
    [result] = reader.poll()
    assert not result.ok and result.error == "transport closed"
    with pytest.raises(RuntimeError, match="closed"):
        reader.start_read("late", "prefill", [1], [1])
    server.close()


def test_wakeup_hook_fires_when_a_result_is_ready():
    woken = threading.Event()
    server = create_transport("tcp", _cache(seed=1), role="producer")
    reader = create_transport("tcp", _cache(), role="consumer", wakeup=woken.set)
    try:
        reader.add_remote("prefill", server.local_metadata())
        reader.start_read("r", "prefill", [1], [1])
        assert woken.wait(5.0)
        assert [r.ok for r in reader.poll()] == [True]
    finally:
        reader.close()
        server.close()


def test_no_pickle_on_the_wire(pair, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    server, reader = pair
    reader.start_read("r", "prefill", [1, 2], [3, 4])
    assert [r.ok for r in reader.wait(5.0)] == [True]
