"""CPU time each server process spent during a benchmark run, by role, per streamed token.

On a small machine every process competes for the same cores: a router or an engine front that
spends a millisecond of CPU per token takes it from an engine core. This reads each process's
CPU time (all its threads, to the nanosecond) before and after a client run, names
each process by what it is (pdserve's router, an engine's front or core, the cluster's
supervisor; another server by its command name), and divides by the tokens the client received.
Roles summed across engines of the same kind (two decode engines: one ``decode-core``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

CLK_TCK = os.sysconf("SC_CLK_TCK")
# pdserve's processes outside the engine cores: what issue 42 budgets per streamed token.
OUTSIDE_ENGINE_ROLES = ("router", "prefill-front", "decode-front", "serve-front", "cluster")


def proc_stats() -> dict[int, list[str]]:
    """{pid: the fields of /proc/PID/stat after "pid (comm)"}: state(0) ppid(1) pgrp(2)
    session(3) ... utime(11) stime(12) cutime(13) cstime(14)."""
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stats[int(name)] = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
    return stats


def session_pids(stats: dict[int, list[str]], sessions: set[int]) -> set[int]:
    """The live processes of ``sessions`` and every descendant of theirs, whatever session it
    leads (``pdserve cluster`` starts each engine in a session of its own)."""
    ours = {pid for pid, fields in stats.items() if int(fields[3]) in sessions} | (sessions & stats.keys())
    grew = True
    while grew:
        added = {pid for pid, fields in stats.items() if pid not in ours and int(fields[1]) in ours}
        ours |= added
        grew = bool(added)
    return ours


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


PDSERVE_COMMANDS = ("router", "prefill", "decode", "serve", "cluster")


def role_of(pid: int, stats: dict[int, list[str]]) -> str:
    """What process ``pid`` is: "router", "<role>-front", "<role>-core", "cluster", or (not
    pdserve's) its command name."""
    argv = _cmdline(pid)
    if "pdserve.engine.core_proc" in argv:
        parent = int(stats[pid][1]) if pid in stats else 0
        return f"{_pdserve_command(_cmdline(parent)) or 'engine'}-core"
    command = _pdserve_command(argv)
    if command in ("prefill", "decode", "serve"):
        return f"{command}-front"
    return command or _comm(pid)


def _pdserve_command(argv: list[str]) -> str | None:
    """The pdserve subcommand of a command line (``python -m pdserve --log-level INFO decode
    ...``, ``.venv/bin/pdserve cluster ...``), or None when it is not pdserve's."""
    for index, part in enumerate(argv):
        if part == "pdserve" or part.endswith("/pdserve"):
            for arg in argv[index + 1 :]:
                if arg in PDSERVE_COMMANDS:
                    return arg
            return None
    return None


def cpu_seconds(pid: int, fields: list[str]) -> float:
    """CPU seconds process ``pid`` has run, all its threads (those that ended too).

    Read from the process's CPU-time clock (Linux's ``clock_getcpuclockid``: clock id
    ``(~pid << 3) | 2``, its scheduler's runtime in nanoseconds), not ``/proc/PID/stat``'s
    utime + stime: those count 10 ms ticks, so each process's figure over a run was off by up to
    10 ms. Summed over a router, two fronts and a supervisor that was up to ~10 us per token
    on a 4,096-token run, a tenth of issue 42's 100 us budget; an engine front that spent 2 ms
    read as 0 or 10. ``fields`` (its ``/proc/PID/stat``) is the fallback where the clock is
    refused."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:  # it exited meanwhile, or the kernel refuses: its ticks
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


class ProcessCpu:
    """``with ProcessCpu(server_session_leaders) as cpu: ...`` then ``cpu.seconds``: {role: CPU
    seconds its processes spent inside the block}. A process that exited during the block takes
    its time with it (its parent reaps it into cutime, not counted here)."""

    def __init__(self, session_leaders: Iterable[int]) -> None:
        self.sessions = set(session_leaders)
        self.seconds: dict[str, float] = {}
        self._start: dict[int, float] = {}
        self._roles: dict[int, str] = {}

    def _sample(self) -> dict[int, float]:
        stats = proc_stats()
        spent = {}
        for pid in session_pids(stats, self.sessions):
            if pid not in self._roles:
                self._roles[pid] = role_of(pid, stats)
            spent[pid] = cpu_seconds(pid, stats[pid])
        return spent

    def __enter__(self) -> ProcessCpu:
        self._start = self._sample()
        return self

    def __exit__(self, *exc_info: object) -> None:
        seconds: dict[str, float] = {}
        for pid, spent in self._sample().items():
            role = self._roles[pid]
            seconds[role] = seconds.get(role, 0.0) + spent - self._start.get(pid, 0.0)
        self.seconds = {role: round(s, 6) for role, s in sorted(seconds.items())}

    def us_per_token(self, tokens: int | None) -> dict[str, float] | None:
        """{role: CPU microseconds per streamed token}, plus "outside_engines" (pdserve's router,
        fronts and supervisor together); None without tokens."""
        if not tokens:
            return None
        per = {role: round(s / tokens * 1e6, 1) for role, s in self.seconds.items()}
        outside = [per[role] for role in OUTSIDE_ENGINE_ROLES if role in per]
        if outside:
            per["outside_engines"] = round(sum(outside), 1)
        return per
