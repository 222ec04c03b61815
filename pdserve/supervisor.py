"""Local child processes under supervision: spawned safely, health-gated, stopped in order.

``pdserve cluster`` (``pdserve.cluster``), ``pdserve bench serve`` and the test harnesses all run
routers and engines as local processes the same way, and this module is that one way:

- ``SupervisedProcess`` is one child: its command, log file, gRPC address and optional CPU set.
  It runs in a session of its own (a Ctrl-C in the terminal reaches only the supervisor, which
  stops the children in order, and a kill of its process group also takes the engine core an
  engine front starts), and it gets SIGTERM from the kernel when its parent goes away.
- ``wait_healthy`` polls the standard gRPC health service of some children until they report
  SERVING, and tells apart a child that lost its port from one that failed.
- ``terminate_all`` stops children together: SIGTERM, a grace period, then SIGKILL.
- ``Supervisor`` starts children in waves (each wave healthy before the next one starts, lost
  ports retried) and stops the waves in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from pdserve import healthcheck

DEFAULT_GRACE_S = 10.0
# A port picked free can be taken by another process before the child binds it: that many tries.
MAX_BIND_ATTEMPTS = 3
# What a pdserve process logs (lower-cased) when its port is taken.
BIND_FAILURE_MARKERS = ("address already in use", "failed to bind", "errno 98")
PROGRESS_EVERY_S = 10.0
POLL_S = 0.2
# pick_free_ports' range starts here (below: well-known and registered services' ports).
FIXED_PORTS_FROM = 20000
# "LOW-HIGH" (HIGH excluded): where pick_free_ports picks instead. The test suite gives each
# xdist worker a slice of its own, so two workers' clusters never pick the same port.
FREE_PORTS_ENV = "PDSERVE_FREE_PORTS"
PICK_ATTEMPTS = 200

# Runs in each child before the real command: ask for SIGTERM when the parent dies, pin to the
# CPUs in argv[2] if any, then exec the command in argv[3:] (same pid, so nothing else changes).
# PR_SET_PDEATHSIG (1) survives execve; the ppid check covers a parent that died before prctl.
# A shim rather than Popen's preexec_fn, which is unsafe in a process that runs threads (gRPC).
_EXEC_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "if sys.argv[2]:\n"
    "    os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(',')})\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


class SupervisorError(RuntimeError):
    """A supervised process failed to start or died."""


class StartupStopped(SupervisorError):
    """Start-up was interrupted because a stop was requested."""


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free right now (all held open together so none repeats).

    Picked at random below the kernel's ephemeral range (``ip_local_port_range``), where it
    never hands a port out by itself: an outgoing connection or a bind to port 0 of any
    process on the machine (parallel tests open thousands) cannot take one before our child
    binds it; only another explicit bind can. Free *now* only all the same, which is why
    starting retries a child that lost its port (``Supervisor.start``). Where that range
    leaves too little room below it, the kernel picks (a bind to port 0).
    ``$PDSERVE_FREE_PORTS`` narrows the range (``free_port_range``).
    """
    start, stop = free_port_range()
    sockets: list[socket.socket] = []
    tried: set[int] = set()
    rng = random.Random()
    try:
        while len(sockets) < count:
            if stop - start >= 1000 and len(tried) < PICK_ATTEMPTS:
                port = rng.randrange(start, stop)
                if port in tried:
                    continue
                tried.add(port)
            else:
                port = 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                if port == 0:
                    raise
                continue
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port_range() -> tuple[int, int]:
    """``[start, stop)`` that ``pick_free_ports`` picks from: ``$PDSERVE_FREE_PORTS`` when set,
    else from ``FIXED_PORTS_FROM`` up to the kernel's ephemeral range.

    Another process's explicit bind is the one thing that can take a picked port before the
    child binds it; when that process is a parallel test's engine, our router would talk to
    *its* model (seen once in CI). Disjoint ranges per test worker rule that out.
    """
    value = os.environ.get(FREE_PORTS_ENV, "").strip()
    if not value:
        return FIXED_PORTS_FROM, ephemeral_port_range()[0]
    try:
        start, stop = (int(field) for field in value.split("-"))
    except ValueError:
        raise ValueError(f"${FREE_PORTS_ENV} must be LOW-HIGH (two port numbers), not {value!r}") from None
    if not 0 < start < stop <= 65536:
        raise ValueError(f"${FREE_PORTS_ENV}={value!r}: need 0 < LOW < HIGH <= 65536")
    return start, stop


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(field) for field in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def check_health(address: str, timeout_s: float = 1.0) -> bool:
    """True when the gRPC health service at ``address`` reports SERVING for the whole server."""
    return healthcheck.check(address, timeout_s=timeout_s)[0]


class SupervisedProcess:
    """One child process: command line, log file, gRPC address, and the ``Popen`` once spawned.

    ``argv`` is the whole command (``[sys.executable, "-m", "pdserve", ...]``); stdout and
    stderr go to ``log_path`` (appended to, so a restart keeps the earlier run's lines). The
    child leads its own process group, which holds whatever it starts (an engine's core).
    Children die with the *thread* that spawned them (PR_SET_PDEATHSIG follows the thread), so
    spawn from a thread that outlives them.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        address: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        cpus: Iterable[int] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = str(log_path)
        self.address = address  # gRPC host:port whose health gates start-up
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.cpus = sorted(cpus) if cpus else []
        self.popen: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, address={self.address!r}, pid={self.pid})"

    def spawn(self) -> None:
        """Start the command (again, after it has exited: same command line, same log)."""
        assert not self.alive, f"{self.name} is already running"
        command = self.argv
        if sys.platform.startswith("linux"):
            pinned = ",".join(str(c) for c in self.cpus)
            command = [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), pinned, *self.argv]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal); None while running or never spawned."""
        return self.popen.poll() if self.popen is not None else None

    def send_signal(self, sig: int) -> None:
        """Signal the child itself (not its group): an engine front drains on SIGTERM."""
        assert self.popen is not None, f"{self.name} was never spawned"
        self.popen.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """Signal the child and everything it started; a group already gone is not an error."""
        assert self.popen is not None, f"{self.name} was never spawned"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it has exited; ``subprocess.TimeoutExpired`` after ``timeout``."""
        assert self.popen is not None, f"{self.name} was never spawned"
        return self.popen.wait(timeout)

    def terminate(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """SIGTERM, then SIGKILL to its whole group after ``grace_s``."""
        terminate_all([self], grace_s)

    def healthy(self) -> bool:
        """Whether start-up is over: its gRPC health service reports SERVING."""
        assert self.address is not None, f"{self.name} has no address to ask for its health"
        return check_health(self.address, timeout_s=0.5)

    def lost_port(self) -> bool:
        """It has exited because its port was taken (so it may be started again on another)."""
        return not self.alive and any(m in self.log_tail().lower() for m in BIND_FAILURE_MARKERS)

    def describe_exit(self) -> str:
        code = self.returncode
        if code is None:
            return "is running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_text(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as log:
            return log.read()
        return ""

    def log_tail(self, num_lines: int = 30) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-num_lines:])


def wait_healthy(
    children: Sequence[SupervisedProcess],
    timeout_s: float,
    *,
    retry_lost_port: bool = False,
    stop: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
    since: float | None = None,
    poll_s: float = POLL_S,
) -> list[SupervisedProcess]:
    """Poll until every child is healthy; returns those that lost their port to another process.

    A child that exits fails the start-up (``SupervisorError`` with its log's last lines), unless
    it exited on a taken port and ``retry_lost_port`` is set: then it is returned, for the caller
    to start again on another port. ``stop`` being set raises ``StartupStopped``; ``since`` (a
    ``time.monotonic()`` value, default now) is where the ``timeout_s`` and the reported times
    count from; ``poll_s`` spaces the checks (longer for a costly ``healthy()``).
    """
    say = progress or (lambda message: None)
    since = time.monotonic() if since is None else since
    pending = list(children)
    lost: list[SupervisedProcess] = []
    last_note = time.monotonic()
    while pending:
        if stop is not None and stop.is_set():
            raise StartupStopped("stop requested during start-up")
        for child in list(pending):
            if not child.alive:
                pending.remove(child)
                if child.lost_port():
                    if retry_lost_port:
                        lost.append(child)
                        continue
                    raise SupervisorError(f"{child.name} could not bind {child.address}:\n{child.log_tail()}")
                raise SupervisorError(
                    f"{child.name} {child.describe_exit()} during start-up; its log:\n{child.log_tail()}"
                )
            if child.healthy():
                pending.remove(child)
                say(f"{child.name} ready on {child.address} ({time.monotonic() - since:.1f}s)")
        if not pending:
            break
        elapsed = time.monotonic() - since
        if elapsed > timeout_s:
            names = ", ".join(c.name for c in pending)
            raise SupervisorError(
                f"{names} not healthy after {timeout_s:.0f}s; the log of {pending[0].name} "
                f"({pending[0].log_path}) ends:\n{pending[0].log_tail()}"
            )
        if time.monotonic() - last_note >= PROGRESS_EVERY_S:
            last_note = time.monotonic()
            say(f"waiting for {', '.join(c.name for c in pending)} ({elapsed:.0f}s)")
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
    return lost


def terminate_all(children: Iterable[SupervisedProcess], grace_s: float) -> None:
    """Stop children together: SIGTERM each, wait up to ``grace_s`` for all, then SIGKILL.

    SIGTERM goes to the child alone, so an engine front can drain and stop its own core; the
    SIGKILL goes to each child's whole group, which also takes anything it left behind. Only the
    groups of children that were running when called are killed: the group id of a child reaped
    long ago may belong to another process by now.
    """
    live = [c for c in children if c.alive]
    for child in live:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
    for child in live:
        child.signal_group(signal.SIGKILL)
        child.wait()


Member = TypeVar("Member")


class Supervisor:
    """Children started in waves, each healthy before the next; stopped in reverse wave order.

    ``start(members, build)`` builds a ``SupervisedProcess`` for each member (``build`` picks its
    ports and command line), spawns them together and waits until all are healthy. A child that
    lost its port is built again, on new ports, up to ``MAX_BIND_ATTEMPTS`` times. ``children``
    lists every spawned child in start order (those that lost their port are dropped); ``stop()``
    stops the last wave first (a router before the engines it sends to). Children of a wave whose
    start-up failed are tracked too, so ``stop()`` also ends them.
    """

    def __init__(
        self,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        progress: Callable[[str], None] | None = None,
        stop_event: threading.Event | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s  # between two rounds of health checks
        self.progress = progress or (lambda message: None)
        self.stop_event = stop_event  # set by another thread: start-up gives up (StartupStopped)
        self.waves: list[tuple[list[SupervisedProcess], float]] = []  # [(children, grace_s)], start order

    @property
    def children(self) -> list[SupervisedProcess]:
        return [child for wave, _ in self.waves for child in wave]

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(
        self,
        members: Sequence[Member],
        build: Callable[[Sequence[Member]], Sequence[SupervisedProcess]],
        *,
        timeout_s: float,
        retry_lost_port: bool = True,
        grace_s: float | None = None,
    ) -> list[SupervisedProcess]:
        """Start one wave: ``build(members)`` returns their children in member order; once all are
        healthy, returns them in member order. ``retry_lost_port=False`` when ports are fixed."""
        wave: list[SupervisedProcess] = []
        self.waves.append((wave, self.grace_s if grace_s is None else grace_s))
        ready: dict[int, SupervisedProcess] = {}  # {member index: child}
        todo = list(range(len(members)))
        since = time.monotonic()
        for attempt in range(1, MAX_BIND_ATTEMPTS + 1):
            built = build([members[i] for i in todo])
            assert len(built) == len(todo), f"build gave {len(built)} processes for {len(todo)} members"
            for child in built:
                child.spawn()
                wave.append(child)
                pinned = f" (cpu {','.join(map(str, child.cpus))})" if child.cpus else ""
                self.progress(f"starting {child.name} on {child.address}{pinned} (log: {child.log_path})")
            lost = wait_healthy(
                built,
                timeout_s,
                retry_lost_port=retry_lost_port and attempt < MAX_BIND_ATTEMPTS,
                stop=self.stop_event,
                progress=self.progress,
                since=since,
                poll_s=self.poll_s,
            )
            ready.update((i, child) for i, child in zip(todo, built, strict=True) if child not in lost)
            if not lost:
                return [ready[i] for i in range(len(members))]
            for child in lost:
                self.progress(f"{child.name}: port taken by another process, retrying on a new one")
                wave.remove(child)
                child.signal_group(signal.SIGKILL)  # its engine core, if it got that far
            todo = [i for i, child in zip(todo, built, strict=True) if child in lost]
        raise AssertionError("unreachable: the last attempt does not retry")

    def dead(self) -> list[SupervisedProcess]:
        """Children that have exited (none should while the supervisor runs)."""
        return [child for child in self.children if child.returncode is not None]

    def check(self) -> None:
        """``SupervisorError`` naming every child that has exited, with their logs' last lines."""
        dead = self.dead()
        if dead:
            summary = "; ".join(f"{c.name} ({c.address}) {c.describe_exit()}" for c in dead)
            tails = "".join(f"\n--- last lines of {c.log_path}:\n{c.log_tail()}" for c in dead)
            raise SupervisorError(summary + tails)

    def wait_for_exit(self, wake: socket.socket, poll_s: float = 0.5) -> None:
        """Sleep until a child exits or ``wake`` becomes readable (its bytes are drained).

        Each child's pidfd and ``wake`` sit in one ``select``, so a supervisor with nothing to
        do never wakes: a check every half second cost ``pdserve cluster`` about 2 ms of CPU a
        second on a 2-core VM (cold caches), taken from the engine cores. Without pidfds (not
        Linux), children are polled every ``poll_s``."""
        with selectors.DefaultSelector() as selector:
            selector.register(wake, selectors.EVENT_READ)
            pidfds = []
            try:
                for child in self.children:
                    if child.pid is not None:
                        pidfds.append(os.pidfd_open(child.pid))
                        selector.register(pidfds[-1], selectors.EVENT_READ)
            except (AttributeError, OSError):
                poll: float | None = poll_s
            else:
                poll = None
            try:
                while not self.dead():
                    events = selector.select(poll)
                    if any(key.fileobj is wake for key, _ in events):
                        with contextlib.suppress(BlockingIOError):
                            wake.recv(4096)
                        return
            finally:
                for fd in pidfds:
                    os.close(fd)

    def stop(self) -> None:
        """Stop the waves, last started first, each with its grace period. Idempotent."""
        for wave, grace_s in reversed(self.waves):
            terminate_all(wave, grace_s)
