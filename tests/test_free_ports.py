"""``pick_free_ports``: ports a child can bind after the pick, which the kernel hands to no one
meanwhile: picked by the kernel, a parallel test's outgoing connection could take an engine's
KV port before the engine bound it (seen once as "Address already in use")."""

from __future__ import annotations

import os
import socket

import pytest

from pdserve import supervisor

HOST = "127.0.0.1"


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, port))
    return sock


def test_picked_ports_are_distinct_free_and_below_the_kernels_ephemeral_range():
    low, high = supervisor.ephemeral_port_range()
    assert 0 < low <= high
    ports = supervisor.pick_free_ports(HOST, 20)
    assert len(set(ports)) == 20
    assert all(supervisor.FIXED_PORTS_FROM <= port < low for port in ports), ports
    for sock in [_bind(port) for port in ports]:  # each free for the child once picked
        sock.close()


def test_a_port_in_use_is_skipped(monkeypatch):
    in_use, free = supervisor.pick_free_ports(HOST, 2)
    holder = _bind(in_use)
    holder.listen()

    class FirstTheTakenPort:
        def __init__(self) -> None:
            self.picks = iter([in_use, in_use, free])

        def randrange(self, start: int, stop: int) -> int:
            return next(self.picks)

    monkeypatch.setattr(supervisor.random, "Random", FirstTheTakenPort)
    try:
        assert supervisor.pick_free_ports(HOST, 1) == [free]
    finally:
        holder.close()


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(supervisor.FREE_PORTS_ENV, raising=False)
    low, high = supervisor.ephemeral_port_range()
    monkeypatch.setattr(supervisor, "ephemeral_port_range", lambda: (supervisor.FIXED_PORTS_FROM + 10, high))
    ports = supervisor.pick_free_ports(HOST, 3)
    assert len(set(ports)) == 3 and all(low <= port <= high for port in ports), ports


def test_free_ports_variable_narrows_the_range(monkeypatch):
    monkeypatch.setenv(supervisor.FREE_PORTS_ENV, "41000-42500")
    ports = supervisor.pick_free_ports(HOST, 10)
    assert len(set(ports)) == 10 and all(41000 <= port < 42500 for port in ports), ports


def test_a_malformed_free_ports_variable_is_refused_by_name(monkeypatch):
    for value in ("41000", "a-b", "42500-41000", "0-100", "1-70000"):
        monkeypatch.setenv(supervisor.FREE_PORTS_ENV, value)
        with pytest.raises(ValueError, match=supervisor.FREE_PORTS_ENV):
            supervisor.pick_free_ports(HOST, 1)


def test_each_test_worker_picks_from_a_slice_of_its_own():
    """The conftest gives each xdist worker its own slice: two workers' clusters never share a
    port (a router once reached the other worker's tiny-model engine through one)."""
    if not os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
        pytest.skip("runs under xdist (make test)")
    start, stop = supervisor.free_port_range()
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    full_start, full_stop = supervisor.FIXED_PORTS_FROM, supervisor.ephemeral_port_range()[0]
    assert stop - start == (full_stop - full_start) // workers
    assert start == full_start + int(os.environ["PYTEST_XDIST_WORKER"][2:]) * (stop - start)
