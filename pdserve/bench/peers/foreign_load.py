"""How much CPU other work took while a benchmark ran, so a number taken on a shared machine says so.

The machine's busy time (``/proc/stat``) over a run, minus what our own processes used: this
process and the children it reaped (the client), and every process in the sessions of the
servers under test (each supervised child leads a session of its own, which holds whatever it
starts: an engine core, vLLM's workers). What is left, divided by the run's wall time, is the
average number of cores that other work kept busy. A server process that exits during the run
takes its CPU time with it, so the figure is an upper bound when that happens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from pdserve.bench.peers.process_cpu import CLK_TCK, proc_stats, session_pids


def _busy_ticks() -> int:
    """CPU ticks the whole machine spent busy (user, nice, system, irq, softirq) since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return user + nice + system + irq + softirq


def _session_ticks(sessions: set[int]) -> int:
    """CPU ticks used by the live processes of ``sessions`` and their descendants, including the
    children they reaped."""
    stats = proc_stats()
    return sum(sum(int(v) for v in stats[pid][11:15]) for pid in session_pids(stats, sessions))


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class ForeignLoad:
    """``with ForeignLoad(server_pids) as load: ...`` then ``load.cores``: the mean number of cores
    busy with work that is neither this process, its reaped children, nor those servers."""

    def __init__(self, session_leaders: Iterable[int]) -> None:
        self.sessions = set(session_leaders)
        self.cores: float | None = None

    def _ours_s(self) -> float:
        return _own_seconds() + _session_ticks(self.sessions) / CLK_TCK

    def __enter__(self) -> ForeignLoad:
        self._start = (time.monotonic(), _busy_ticks() / CLK_TCK, self._ours_s())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall0, busy0, ours0 = self._start
        wall = time.monotonic() - wall0
        other_s = (_busy_ticks() / CLK_TCK - busy0) - (self._ours_s() - ours0)
        self.cores = round(max(0.0, other_s) / wall, 2) if wall > 0 else None
