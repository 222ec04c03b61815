"""``pick_free_ports``: ports a child can bind after the pick, which the kernel hands to no one
meanwhile: picked by the kernel, a parallel test's outgoing connection could take an engine's
KV port before the engine bound it (seen once as "Address already in use")."""

from __future__ import annotations

import socket

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
    low, high = supervisor.ephemeral_port_range()
    monkeypatch.setattr(supervisor, "ephemeral_port_range", lambda: (supervisor.FIXED_PORTS_FROM + 10, high))
    ports = supervisor.pick_free_ports(HOST, 3)
    assert len(set(ports)) == 3 and all(low <= port <= high for port in ports), ports
