"""Every available transport between two OS processes: exact bytes, dead and stalled peers.

The prefill side runs in a child process (``_prefill_main``); this test process is
decode. They exchange metadata over a pipe as msgpack bytes. A transport whose library is not
importable here is skipped; one that imports but fails is a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import msgpack
import pytest
import torch

from pdserve.connector.transports import ALL_TRANSPORTS, create_transport, transport_class, unavailable_reason
from pdserve.engine.kv_layout import KVCacheSpec

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")  # 32 KiB/block
NUM_BLOCKS = 64
SEED = 1234
DEADLINE_S = 2.0


def _source_cache() -> torch.Tensor:
    """Prefill's cache: random, and the same in both processes (decode checks bytes against it)."""
    g = torch.Generator().manual_seed(SEED)
    return torch.rand((NUM_BLOCKS, *SPEC.block_shape), generator=g)


def _prefill_main(conn: Any, transport: str, options: dict[str, Any]) -> None:
    """Child process: serve reads of a random cache until told to stop, then list what was served."""
    torch.set_num_threads(1)
    if "fault" in options:
        from pdserve.connector.transports.tcp import TcpFault

        options = {**options, "fault": TcpFault(**options["fault"])}
    cache = _source_cache()
    if transport_class(transport).needs_shared_cache:  # shm: a cache the reader can map
        shared = SPEC.allocate(NUM_BLOCKS, shared=True)
        shared.copy_(cache)
        cache = shared
    server = create_transport(transport, cache, role="producer", engine_id="prefill", **options)
    conn.send_bytes(msgpack.packb({"metadata": server.local_metadata()}))
    expected = msgpack.unpackb(conn.recv_bytes())  # transfer ids decode expects us to report
    served: list[str] = []
    deadline = time.time() + 5.0
    while server.track_served and not set(expected) <= set(served) and time.time() < deadline:
        served += [s.transfer_id for s in server.poll_served() if s.reader == "decode"]
        time.sleep(0.005)
    server.close()
    conn.send_bytes(msgpack.packb(served))


def _process_context() -> Any:
    """Children fork from a fresh forkserver that has torch imported already: a clean process
    (no UCX or NIXL state of this one inherited), and no multi-second torch import per child."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "msgpack", "pdserve.connector.transports.tcp"])
    return ctx


class Prefill:
    """Handle on a prefill child process (started at once, waited for in ``ready``)."""

    def __init__(self, transport: str, **options: Any) -> None:
        ctx = _process_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, transport, options), daemon=True)
        self.proc.start()
        self.metadata: dict[str, Any] = {}
        self.pid: int = self.proc.pid  # this child's own pid: signals go to it alone
        assert self.pid > 0

    def ready(self) -> Prefill:
        if not self.metadata:
            if not self.conn.poll(60):
                raise TimeoutError("prefill child did not start")
            self.metadata = msgpack.unpackb(self.conn.recv_bytes())["metadata"]
        return self

    def served(self, expected: list[str]) -> list[str]:
        self.conn.send_bytes(msgpack.packb(expected))
        assert self.conn.poll(30), "prefill child did not answer"
        served = msgpack.unpackb(self.conn.recv_bytes())
        self.proc.join(10)
        return served

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread is really stopped (delivery is asynchronous)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.time() + 5.0
        while time.time() < deadline:
            states = []
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)
        raise TimeoutError("prefill did not stop")

    def kill(self) -> None:
        self.proc.kill()  # multiprocessing signals its own child only (a no-op once it has exited)
        self.proc.join(10)


FAULTS = {"stall": "timed out", "drop": "connection to prefill failed"}


@pytest.fixture(scope="module")
def prefills():
    """Every prefill child this module needs, spawned together: their start-up (importing
    torch) overlaps instead of adding up. Keys: (test kind, transport or fault)."""
    children: dict[tuple[str, str], Prefill] = {}
    for transport in ALL_TRANSPORTS:
        if unavailable_reason(transport) is None:
            # "exact" lists the reads it served; "killed" serves as an engine does, keeping none.
            children["exact", transport] = Prefill(transport, track_served=True)
            children["killed", transport] = Prefill(transport)
    if unavailable_reason("nixl") is None:
        children["engine", "nixl"] = Prefill("nixl")
    block = SPEC.bytes_per_block
    for action in FAULTS:
        fault = {"after_bytes": block + block // 2, "action": action, "times": 1}
        children["fault", action] = Prefill("tcp", fault=fault, track_served=True)
    yield children
    for child in children.values():
        child.kill()


def _needs(transport: str) -> None:
    reason = unavailable_reason(transport)
    if reason is not None:
        pytest.skip(f"{transport} not available: {reason}")


def _decode(transport: str, prefill: Prefill) -> Any:
    reader = create_transport(
        transport,
        torch.zeros((NUM_BLOCKS, *SPEC.block_shape)),
        role="consumer",
        engine_id="decode",
        spec=SPEC,
        transfer_timeout_s=DEADLINE_S,
    )
    reader.add_remote("prefill", prefill.metadata)
    return reader


def _wait_all(reader: Any, count: int, timeout_s: float) -> list[Any]:
    results: list[Any] = []
    deadline = time.perf_counter() + timeout_s
    while len(results) < count and time.perf_counter() < deadline:
        results += reader.wait(deadline - time.perf_counter())
    return results


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_decode_reads_scattered_blocks_into_other_blocks_exactly(transport, prefills):
    _needs(transport)
    prefill = prefills["exact", transport].ready()
    reader = _decode(transport, prefill)
    try:
        source = _source_cache()
        # Non-contiguous on both sides, a run of 3 contiguous on both, one block read twice.
        reads = {
            "a": ([7, 3, 50, 51, 52, 0, 63], [1, 60, 20, 21, 22, 5, 9]),
            "b": ([11, 12, 13, 14], [40, 30, 31, 32]),
            "c": ([7], [63]),
        }
        for tid, (remote, local) in reads.items():
            reader.start_read(tid, "prefill", remote, local)
        results = _wait_all(reader, len(reads), 10.0)
        assert sorted((r.transfer_id, r.ok, r.error) for r in results) == [
            (t, True, None) for t in sorted(reads)
        ]
        written = set()
        for remote, local in reads.values():
            assert torch.equal(reader.kv_cache[local], source[remote])
            written |= set(local)
        assert not reader.kv_cache[[b for b in range(NUM_BLOCKS) if b not in written]].any()

        # Blocks the peer does not have: a failed read, never a hang, and the peer stays usable.
        reader.remove_remote("prefill")
        reader.add_remote("prefill", {**prefill.metadata, "num_blocks": 4 * NUM_BLOCKS})
        reader.start_read("beyond", "prefill", [NUM_BLOCKS + 1], [0])
        [beyond] = _wait_all(reader, 1, DEADLINE_S + 3.0)
        assert not beyond.ok
        reader.start_read("again", "prefill", [2, 3], [0, 1])
        [again] = _wait_all(reader, 1, 10.0)
        assert again.ok, again.error
        assert torch.equal(reader.kv_cache[[0, 1]], source[[2, 3]])
    finally:
        reader.close()
    served = prefill.served(["a", "b", "c", "again"])
    if transport_class(transport).reports_served:  # shm: prefill takes no part in a read
        assert set(served) >= {"a", "b", "c", "again"}


def test_nixl_prefill_whose_driver_sleeps_is_still_read_exactly_on_one_host(prefills):
    """A NIXL producer built as the engines build it keeps no served reads, and one told to
    expect no reads (an idle prefill engine, holding no lease) never wakes its driver. On one
    host a read is one-sided (CMA), so every read, the first one too, is exact all the same."""
    _needs("nixl")
    prefill = prefills["engine", "nixl"].ready()
    reader = _decode("nixl", prefill)
    try:
        source = _source_cache()
        for i in range(4):
            reader.start_read(f"r{i}", "prefill", [2 * i, 40 + i], [i, 20 + i])
        results = _wait_all(reader, 4, 10.0)
        assert sorted((r.transfer_id, r.ok) for r in results) == [(f"r{i}", True) for i in range(4)]
        for i in range(4):
            assert torch.equal(reader.kv_cache[[i, 20 + i]], source[[2 * i, 40 + i]])
    finally:
        reader.close()
    assert prefill.served(["r0"]) == []


def test_nixl_producer_wakes_to_make_progress_only_while_it_expects_reads():
    """Fetching notifications is how a NIXL producer makes progress, which a read over UCX's
    TCP (no one-sided reads) needs from its side, and it costs a wake-up every few ms. So it
    polls only while told to expect reads (the P/D connector: while it holds a lease) or while
    it keeps served reads, and otherwise sleeps until asked for something."""
    _needs("nixl")
    with create_transport("nixl", SPEC.allocate(NUM_BLOCKS), role="producer", spec=SPEC) as engine:
        assert engine._idle_wait() is None
        engine.expect_reads(True)
        assert engine._idle_wait() is not None
        engine.expect_reads(False)
        assert engine._idle_wait() is None
    with create_transport(
        "nixl", SPEC.allocate(NUM_BLOCKS), role="producer", spec=SPEC, track_served=True
    ) as tracking:
        assert tracking._idle_wait() is not None
    with create_transport("nixl", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC) as reader:
        reader.expect_reads(True)  # a reader serves nothing: it never polls
        assert reader._idle_wait() is None


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_prefill_killed_mid_transfer_fails_the_read_within_the_deadline(transport, prefills):
    _needs(transport)
    prefill = prefills["killed", transport].ready()
    reader = _decode(transport, prefill)
    try:
        reader.start_read("warm", "prefill", [1, 2], [1, 2])  # connection up before the crash
        assert [r.ok for r in _wait_all(reader, 1, 10.0)] == [True]

        prefill.freeze()  # its threads cannot answer the next read
        start = time.perf_counter()
        reader.start_read("doomed", "prefill", list(range(10, 40)), list(range(10, 40)))
        time.sleep(0.2)
        prefill.kill()
        [doomed] = _wait_all(reader, 1, DEADLINE_S + 5.0)
        elapsed = time.perf_counter() - start
        assert elapsed < DEADLINE_S + 1.0
        if transport not in ("nixl", "shm"):  # a one-sided read may finish from a frozen process
            assert not doomed.ok

        # Reads from the dead peer keep failing within the deadline, never hang.
        start = time.perf_counter()
        reader.start_read("after", "prefill", [5], [5])
        [after] = _wait_all(reader, 1, DEADLINE_S + 5.0)
        assert not after.ok
        assert time.perf_counter() - start < DEADLINE_S + 1.0
    finally:
        reader.close()
        prefill.kill()


@pytest.mark.parametrize("action", FAULTS)
def test_tcp_fault_fails_the_read_then_the_peer_recovers(action, prefills):
    error = FAULTS[action]
    prefill = prefills["fault", action].ready()
    reader = _decode("tcp", prefill)
    try:
        start = time.perf_counter()
        reader.start_read("hit", "prefill", [4, 5, 6], [4, 5, 6])
        [hit] = _wait_all(reader, 1, DEADLINE_S + 5.0)
        elapsed = time.perf_counter() - start
        assert not hit.ok and error in hit.error
        if action == "stall":
            assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + 1.0
        else:
            assert elapsed < 1.0
        reader.start_read("next", "prefill", [4, 5, 6], [4, 5, 6])
        [after] = _wait_all(reader, 1, 10.0)
        assert after.ok, after.error
        assert torch.equal(reader.kv_cache[[4, 5, 6]], _source_cache()[[4, 5, 6]])
    finally:
        reader.close()
    assert "next" in prefill.served(["next"])


@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_peer_metadata_without_an_address_is_a_clear_error(transport):
    _needs(transport)
    cache = SPEC.allocate(NUM_BLOCKS, shared=transport_class(transport).needs_shared_cache)
    with create_transport(transport, cache, role="both", engine_id="me") as me:
        meta = me.local_metadata()
        assert msgpack.unpackb(msgpack.packb(meta)) == meta  # what the handshake ships
        broken = {
            "tcp": {"port": None},
            "ucx": {"address": b""},
            "nixl": {"agent_metadata": b"garbage"},
            "shm": {"region": None},
        }
        with pytest.raises(ValueError, match="peer other"):
            me.add_remote("other", {**meta, **broken[transport]})
        assert not me.has_remote("other")
