"""``pdserve cluster``: a router and N prefill + M decode engines as local processes.

``LocalCluster`` starts each engine as ``python -m pdserve prefill|decode ...``, waits until the
standard gRPC health service of every engine reports SERVING, then starts the router on their
addresses and waits for it the same way. The command prints the addresses and stays in the
foreground; Ctrl-C or SIGTERM stops every process (router first, then the engines: SIGTERM, then
SIGKILL after a grace period), and so does any child exiting on its own, which makes the command
exit non-zero naming it.

Each engine's core process (its model steps and torch threads) is pinned to its own share of the
cores this command may use (``plan_engine_cpus``; ``--prefill-cpus`` / ``--decode-cpus`` choose
them, ``--no-cpu-placement`` turns it off), and runs as many torch threads as cores it is given
(``pdserve.engine.cpu_resources``); on a 2-core machine, while an engine is idle the other
borrows its core for its steps (``pdserve.engine.cpu_lending``; ``--no-cpu-lending`` turns it
off), so a lone stream decodes on both cores and a prompt prefills on both. The engine's front
(gRPC server, token streaming) is not pinned, like the router: as vLLM's CPU backend binds only
its worker's OpenMP threads. Pinned with its core, a decode engine's front spent its ~2 ms of Python a streamed token on the core
whose steps it was streaming, which then waited for it.

The router gets the cluster's API keys (``--api-key``, through its environment, never its
command line) and TLS settings; the cluster checks its health over that TLS, trusting
``--ssl-ca-certs`` if given (and then presenting the router's own certificate, which that CA
must have signed for client use too), else the router's certificate itself (grpcio accepts a leaf as its own trust anchor).
The certificate must name ``--host``. ``LocalCluster(router_health_tls=...)`` says otherwise.

The processes are run by ``pdserve.supervisor``: children never outlive the cluster (the kernel
sends each SIGTERM when its parent goes away, and each engine front in turn takes its engine core
down with it), and they get their own session, so a Ctrl-C in the terminal reaches only the
cluster, which stops them in order.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import cast

from pdserve import healthcheck
from pdserve.config import KV_TRANSPORTS
from pdserve.engine.cpu_lending import create_board
from pdserve.engine.cpu_resources import allowed_cpus, format_cpu_list, parse_cpu_list
from pdserve.router.auth import KEYS_ENV, add_key_args, add_tls_args, check_key, front_door_settings
from pdserve.supervisor import (
    DEFAULT_GRACE_S,
    StartupStopped,
    SupervisedProcess,
    Supervisor,
    SupervisorError,
    check_health,
    pick_free_ports,
)
from pdserve.tls import ClientTls, ServerTls

__all__ = [
    "ClusterError",
    "ClusterProcess",
    "ClusterStopped",
    "LocalCluster",
    "add_args",
    "check_health",
    "main",
    "pick_free_ports",
    "plan_engine_cpus",
    "split_cpus",
]

ENGINE_ROLES = ("prefill", "decode")
DEFAULT_STARTUP_TIMEOUT_S = 600.0


# Core lending (pdserve.engine.cpu_lending) is on where the engines' cores are at most this many.
MAX_LENDING_CPUS = 2


def split_cpus(cpus: Sequence[int], count: int) -> list[list[int]]:
    """``count`` groups of ``cpus``: disjoint and as even as possible when there are enough
    (the later groups get the extra ones), else one CPU each, shared round robin."""
    ordered = list(cpus)
    if count <= 0:
        return []
    if len(ordered) < count:
        return [[ordered[i % len(ordered)]] for i in range(count)]
    base, extra = divmod(len(ordered), count)
    groups, start = [], 0
    for i in range(count):
        size = base + (1 if i >= count - extra else 0)
        groups.append(ordered[start : start + size])
        start += size
    return groups


def plan_engine_cpus(
    available: Sequence[int],
    num_prefill: int,
    num_decode: int,
    role_cpus: dict[str, Sequence[int]] | None = None,
) -> dict[str, list[int]]:
    """{engine name: the CPUs it is pinned to}.

    Engines that share cores each run as many torch threads as cores they see, and fight: on 2
    cores, a prefill and a decode engine with 2 threads each made a decode step 5-9x slower
    under load than one thread each on a core of its own. So the engines split the cores this
    process may use between them (decode engines, listed last, get the odd ones out), and a
    role given its own CPUs (``role_cpus``, ``--prefill-cpus`` / ``--decode-cpus``) splits
    those among its engines instead. The router stays unpinned: it is mostly idle.
    """
    role_cpus = role_cpus or {}
    counts = {"prefill": num_prefill, "decode": num_decode}
    unknown = set(role_cpus) - set(counts)
    if unknown:
        raise ValueError(f"cpus given for unknown roles {sorted(unknown)}")
    for role, cpus in role_cpus.items():
        outside = sorted(set(cpus) - set(available))
        if outside:
            raise ValueError(
                f"--{role}-cpus names cpus {outside} this process may not use "
                f"(it may use {format_cpu_list(list(available))})"
            )
    plan: dict[str, list[int]] = {}
    for role, cpus in role_cpus.items():
        for i, group in enumerate(split_cpus(cpus, counts[role])):
            plan[f"{role}-{i}"] = group
    rest = [role for role in ("prefill", "decode") if role not in role_cpus]
    names = [f"{role}-{i}" for role in rest for i in range(counts[role])]
    taken = {cpu for group in plan.values() for cpu in group}
    free = [cpu for cpu in available if cpu not in taken] or list(available)
    for name, group in zip(names, split_cpus(free, len(names)), strict=True):
        plan[name] = group
    return plan


# A process of the cluster failed to start or died / start-up was interrupted by a stop request.
ClusterError = SupervisorError
ClusterStopped = StartupStopped


class ClusterProcess(SupervisedProcess):
    """One child of the cluster: a supervised process with its role and metrics address."""

    address: str  # always given: every child of the cluster is health-checked

    def __init__(
        self,
        name: str,
        role: str,
        argv: list[str],
        log_path: str,
        *,
        address: str,
        metrics_address: str | None,
        env: dict[str, str],
        cpus: Sequence[int] | None = None,
        core_cpus: Sequence[int] | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        super().__init__(name, argv, log_path, address=address, env=env, cpus=cpus)
        self.role = role  # "router", "prefill" or "decode"
        # An engine's core process is pinned here (--core-cpus); the process itself runs anywhere.
        self.core_cpus = sorted(core_cpus) if core_cpus else []
        self.metrics_address = metrics_address  # host:port of Prometheus /metrics
        self.tls = tls  # how to reach its gRPC port when it serves TLS (the router)

    def healthy(self) -> bool:
        return healthcheck.check(self.address, timeout_s=0.5, tls=self.tls)[0]


class LocalCluster:
    """A router and ``num_prefill`` + ``num_decode`` engines as local processes.

    ``with LocalCluster(num_prefill=1, num_decode=1, model=path) as cluster:`` returns once every
    process is healthy; ``cluster.router_address`` is where clients connect. ``cluster.procs`` maps
    each process name (``router``, ``prefill-0``, ``decode-0``, ...) to its ``ClusterProcess``.
    Children die with the thread that started them, so start and stop the cluster from a thread
    that outlives it.

    Ports are picked free at start unless given: ``router_port`` for the router's gRPC port, or
    ``base_port`` B, which gives the k-th process (router k=0, then the prefill engines, then the
    decode engines) gRPC port B+2k and metrics port B+2k+1.
    """

    def __init__(
        self,
        num_prefill: int = 1,
        num_decode: int = 1,
        model: str | None = None,
        *,
        host: str = "127.0.0.1",
        router_port: int | None = None,
        http_port: int | None = None,
        base_port: int | None = None,
        kv_transport: str = "auto",
        policy: str | None = None,
        kv_events: bool = False,
        engine_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        api_keys: Sequence[str] = (),
        tls: ServerTls | None = None,
        router_health_tls: ClientTls | None = None,
        log_dir: str | None = None,
        log_level: str = "INFO",
        env: dict[str, str] | None = None,
        cpus: dict[str, Sequence[int]] | None = None,
        role_cpus: dict[str, Sequence[int]] | None = None,
        place_cpus: bool = True,
        lend_cpus: bool = True,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        grace_s: float = DEFAULT_GRACE_S,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if num_prefill < 0 or num_decode < 1:
            raise ValueError(f"need num_prefill >= 0 and num_decode >= 1, got {num_prefill} and {num_decode}")
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.model = model
        self.host = host
        self.router_port = router_port
        # The router's OpenAI-compatible HTTP port (None: no HTTP front; 0: a free one).
        self.http_port = pick_free_ports(host, 1)[0] if http_port == 0 else http_port
        self.base_port = base_port
        self.kv_transport = kv_transport
        self.policy = policy
        self.kv_events = kv_events  # engines publish KV-cache events on ports they pick
        self.engine_args = list(engine_args)
        self.router_args = list(router_args)
        # Keys the router accepts, on top of any its environment gives it ($PDSERVE_API_KEYS).
        self.api_keys = [check_key(key, "api_keys") for key in api_keys]
        self.tls = tls  # the router's front doors serve TLS with these
        self.router_health_tls = router_health_tls  # how start-up checks reach it (default: from tls)
        # {process name: CPUs it is pinned to}, e.g. {"prefill-0": [0], "decode-0": [1]}; given
        # explicitly (bench serve) or split between the engines (``plan_engine_cpus``); the
        # router and unnamed processes run anywhere.
        if cpus is not None:
            self.cpus = {name: list(c) for name, c in cpus.items()}
        elif place_cpus:
            self.cpus = plan_engine_cpus(allowed_cpus(), num_prefill, num_decode, role_cpus or {})
        else:
            self.cpus = {}
        # Engines pinned to cores of their own lend them to each other while idle (a cpu board
        # in the log dir; pdserve.engine.cpu_lending): a lone stream decodes on both cores.
        self.lend_cpus = lend_cpus
        self.cpu_board: str | None = None
        self.log_level = log_level
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.progress = progress or (lambda message: None)
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir  # a temp dir made by start() when None
        # One random key per cluster authenticates the engines' KV side channel to each other.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))
        self.stop_requested = threading.Event()  # set by request_stop()
        self._wake, self._wake_writer = socket.socketpair()  # request_stop() wakes monitor()
        self._wake.setblocking(False)
        self._wake_writer.setblocking(False)
        # The engines are one wave and the router the next, so stop() takes the router down first.
        self.supervisor = Supervisor(grace_s=grace_s, progress=self.progress, stop_event=self.stop_requested)
        self._failed = False  # a start-up failure keeps a temp log dir for reading
        self._board_slots: dict[str, int] = {}  # engine name -> its slot on the cpu board

    # ------------------------------------------------------------------ addresses

    @property
    def procs(self) -> dict[str, ClusterProcess]:
        """{name: process} of every process started, in start order."""
        # The supervisor holds only what _build made.
        return {proc.name: cast(ClusterProcess, proc) for proc in self.supervisor.children}

    @property
    def router_address(self) -> str:
        return self.procs["router"].address

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (``http://HOST:PORT/v1``)."""
        if self.http_port is None:
            raise ValueError("this cluster was started without an HTTP port")
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}/v1"

    @property
    def prefill_addresses(self) -> list[str]:
        return [p.address for p in self._ordered() if p.role == "prefill"]

    @property
    def decode_addresses(self) -> list[str]:
        return [p.address for p in self._ordered() if p.role == "decode"]

    @property
    def engines(self) -> list[ClusterProcess]:
        return [p for p in self._ordered() if p.role in ENGINE_ROLES]

    def _ordered(self) -> list[ClusterProcess]:
        """Prefill engines, decode engines, router; by index within a role (a retried start
        puts a process after the others of its wave)."""
        rank = {"prefill": 0, "decode": 1, "router": 2}
        return sorted(self.procs.values(), key=lambda p: (rank[p.role], int(p.name.partition("-")[2] or 0)))

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the engines, wait until they are healthy, then the same for the router."""
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="pdserve-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        names = [
            f"{role}-{i}"
            for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode))
            for i in range(n)
        ]
        engine_cpus = [self.cpus.get(name) for name in names]
        all_cpus = {cpu for cpus in engine_cpus for cpu in cpus or ()}
        if self.lend_cpus and len(all_cpus) > MAX_LENDING_CPUS:
            # libgomp lets the workers beyond a smaller team exit and makes new ones from the
            # main thread, pinned to its engine's own cores: with teams of more than 2 threads
            # a lent pool would shrink onto its own cores. Until workers are placed as they are
            # made, lending is for the 2-core machines it was measured on.
            self.progress(
                f"no core lending between the engines: it is for {MAX_LENDING_CPUS} cores, not {len(all_cpus)}"
            )
        elif self.lend_cpus and len(names) > 1 and all(engine_cpus):
            board = os.path.join(self.log_dir, "cpu-board")
            try:
                create_board(board, [list(cpus or ()) for cpus in engine_cpus])
            except ValueError as exc:  # cpus beyond the board's bitmap
                self.progress(f"no core lending between the engines: {exc}")
            else:
                self.cpu_board = board
                self._board_slots = {name: slot for slot, name in enumerate(names)}
        try:
            for wave in (names, ["router"]):
                self.supervisor.start(
                    wave,
                    self._build,
                    timeout_s=self.startup_timeout_s,
                    # Fixed ports (--base-port) cannot move: a taken one fails the start-up.
                    retry_lost_port=self.base_port is None,
                )
        except ClusterStopped:
            raise
        except ClusterError:
            self._failed = True  # keep a temp log dir for reading
            raise

    def _build(self, names: Sequence[str]) -> list[ClusterProcess]:
        """The processes ``names`` on their ports (fresh free ones unless fixed), not yet spawned."""
        if self.base_port is not None:
            index = [0 if name == "router" else 1 + self._engine_index(name) for name in names]
            ports = [(self.base_port + 2 * k, self.base_port + 2 * k + 1) for k in index]
        else:
            free = pick_free_ports(self.host, 2 * len(names))
            ports = [(free[2 * i], free[2 * i + 1]) for i in range(len(names))]
        if self.router_port is not None:
            ports = [
                (self.router_port, mp) if n == "router" else (p, mp)
                for n, (p, mp) in zip(names, ports, strict=True)
            ]
        assert self.log_dir is not None, "start() sets the log dir before building"
        procs = []
        for name, (port, metrics_port) in zip(names, ports, strict=True):
            role = name.split("-")[0]
            argv = [sys.executable, *self._argv(role, port, metrics_port)]
            env, tls = self.env, None
            core_cpus = self.cpus.get(name)
            if role in ENGINE_ROLES:
                argv += ["--engine-id", f"{name}-{port}"]
                if core_cpus:  # the engine's core, not its front (see the module's docstring)
                    argv += ["--core-cpus", format_cpu_list(core_cpus)]
                if self.cpu_board is not None:
                    argv += ["--cpu-board", f"{self.cpu_board}:{self._board_slots[name]}"]
            else:
                env, tls = self._router_env(), self._router_health_tls()
            procs.append(
                ClusterProcess(
                    name,
                    role,
                    argv,
                    os.path.join(self.log_dir, f"{name}.log"),
                    address=f"{self.host}:{port}",
                    metrics_address=f"{self.host}:{metrics_port}",
                    env=env,
                    cpus=None if role in ENGINE_ROLES else core_cpus,
                    core_cpus=core_cpus if role in ENGINE_ROLES else None,
                    tls=tls,
                )
            )
        return procs

    def _router_env(self) -> dict[str, str]:
        """The cluster's environment plus its keys: a command line is visible to every user."""
        if not self.api_keys:
            return self.env
        keys = [k for k in self.env.get(KEYS_ENV, "").split(",") if k.strip()] + self.api_keys
        return {**self.env, KEYS_ENV: ",".join(keys)}

    def _router_health_tls(self) -> ClientTls | None:
        if self.tls is None or self.router_health_tls is not None:
            return self.router_health_tls
        if self.tls.ca_certs is None:
            return ClientTls(ca_certs=self.tls.certfile)
        return ClientTls(self.tls.ca_certs, self.tls.certfile, self.tls.keyfile)

    def _engine_index(self, name: str) -> int:
        """Position among the engines: the prefill engines first, then the decode engines."""
        role, index = name.split("-")
        return int(index) + (self.num_prefill if role == "decode" else 0)

    def _argv(self, role: str, port: int, metrics_port: int) -> list[str]:
        argv = ["-m", "pdserve", "--log-level", self.log_level, role]
        if role == "router":
            argv += ["--host", self.host, "--port", str(port), "--metrics-port", str(metrics_port)]
            argv += [
                "--prefill",
                ",".join(self.prefill_addresses),
                "--decode",
                ",".join(self.decode_addresses),
            ]
            if self.policy:
                argv += ["--policy", self.policy]
            if self.model:
                argv += ["--model", self.model]
            if self.http_port is not None:
                argv += ["--http-port", str(self.http_port)]
            if self.tls is not None:
                argv += self.tls.argv()
            return argv + self.router_args
        argv += ["--host", self.host, "--port", str(port), "--metrics-port", str(metrics_port)]
        argv += ["--kv-transport", self.kv_transport]
        if self.kv_events:
            argv += ["--kv-events-port", "0"]
        if self.model:
            argv += ["--model", self.model]
        return argv + self.engine_args

    def dead_processes(self) -> list[ClusterProcess]:
        """Children that have exited (none should, while the cluster runs)."""
        return cast(list[ClusterProcess], self.supervisor.dead())

    def check(self) -> None:
        """Raise ClusterError if any child has exited."""
        self.supervisor.check()

    def request_stop(self) -> None:
        """Stop ``monitor`` (or a start-up under way): safe from a signal handler or a thread."""
        self.stop_requested.set()
        with contextlib.suppress(OSError):  # full (a stop is asked already) or closed (stopped)
            self._wake_writer.send(b"\0")

    def monitor(self) -> None:
        """Block until ``request_stop`` (returns) or a child exits (raises ClusterError),
        asleep in between."""
        while not self.stop_requested.is_set():
            self.supervisor.wait_for_exit(self._wake)
            self.check()

    def stop(self) -> None:
        """Stop the router, then every engine: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        self.supervisor.stop()
        self._wake.close()
        self._wake_writer.close()
        if self._own_log_dir and self.log_dir and not self._failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def table(self) -> str:
        rows = [("NAME", "ROLE", "GRPC", "METRICS", "PID", "CPUS")]
        for p in self._ordered():
            metrics = f"http://{p.metrics_address}/metrics" if p.metrics_address else "-"
            pinned = p.core_cpus or p.cpus
            cpus = format_cpu_list(pinned) if pinned else "any"
            rows.append((p.name, p.role, p.address, metrics, str(p.pid), cpus))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
        )


# ---------------------------------------------------------------------- command line


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="number of decode engines")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    parser.add_argument("--port", type=int, default=None, help="router gRPC port (default: a free one)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="router's OpenAI-compatible HTTP port (http://HOST:PORT/v1)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="process k (router 0, then engines) gets B+2k, metrics B+2k+1",
    )
    parser.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS))
    parser.add_argument("--policy", default=None, choices=["round_robin", "least_loaded", "prefix", "kv"])
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="engines publish KV-cache events (on free ports) and the router routes on them (policy kv)",
    )
    parser.add_argument(
        "--engine-args",
        default="",
        help='extra engine arguments: "--num-blocks 512", or --engine-args=--no-prefix-caching for one flag',
    )
    parser.add_argument("--router-args", default="", help='extra router arguments, e.g. "--max-inflight 64"')
    parser.add_argument("--log-dir", default=None, help="where each process's log goes (default: a temp dir)")
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    parser.add_argument(
        "--prefill-cpus",
        type=parse_cpu_list,
        default=None,
        help='cpus the prefill engines split between them ("0", "0-3,6"; default: the engines '
        "split every cpu this process may use)",
    )
    parser.add_argument(
        "--decode-cpus", type=parse_cpu_list, default=None, help="cpus the decode engines split between them"
    )
    parser.add_argument(
        "--no-cpu-placement",
        action="store_true",
        help="do not pin the engines: each sees every cpu (and runs as many threads)",
    )
    parser.add_argument(
        "--no-cpu-lending",
        action="store_true",
        help="engines keep to their own cores even while another engine's are idle (by default "
        "an engine borrows an idle engine's cores for its steps)",
    )
    add_key_args(parser)
    add_tls_args(parser)


def main(args: argparse.Namespace) -> int:
    def say(message: str) -> None:
        print(f"[cluster] {message}", flush=True)

    try:
        # Checked here, so a bad key or certificate fails before any engine loads a model.
        keys, tls = front_door_settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    router_args = shlex.split(args.router_args)
    if args.api_key_file:
        router_args += ["--api-key-file", os.path.abspath(args.api_key_file)]
    if args.protect_metrics:
        router_args.append("--protect-metrics")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-")
    try:
        cluster = LocalCluster(
            num_prefill=args.prefill,
            num_decode=args.decode,
            model=args.model,
            host=args.host,
            router_port=args.port,
            http_port=args.http_port,
            base_port=args.base_port,
            kv_transport=args.kv_transport,
            policy=args.policy,
            kv_events=args.kv_events,
            engine_args=shlex.split(args.engine_args),
            router_args=router_args,
            api_keys=args.api_key or (),
            tls=tls,
            log_dir=log_dir,
            # The children log to files: INFO there costs the terminal nothing.
            log_level="DEBUG" if str(getattr(args, "log_level", "")).upper() == "DEBUG" else "INFO",
            startup_timeout_s=args.startup_timeout,
            grace_s=args.grace,
            progress=say,
            role_cpus={
                role: cpus
                for role, cpus in (("prefill", args.prefill_cpus), ("decode", args.decode_cpus))
                if cpus is not None
            },
            place_cpus=not args.no_cpu_placement,
            lend_cpus=not args.no_cpu_lending,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def request_stop(signum: int, frame: object) -> None:
        cluster.request_stop()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    model = args.model or "bundled SmolLM2-135M-Instruct"
    say(f"starting {args.prefill} prefill + {args.decode} decode engines ({model}); logs in {log_dir}")
    code = 0
    try:
        cluster.start()
        print(cluster.table(), flush=True)
        print(f"pdserve cluster ready: router on {cluster.router_address} (Ctrl-C to stop)", flush=True)
        if cluster.http_port is not None:
            print(f"OpenAI-compatible API on {cluster.http_url}", flush=True)
        cluster.monitor()
        say("stopping")
    except ClusterStopped:
        say("stop requested during start-up; stopping")
    except ClusterError as exc:
        # The first line names what failed; the dead processes' own logs say why.
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        for proc in cluster.dead_processes():
            tail = proc.log_tail()
            if tail:
                print(f"--- last lines of {proc.log_path}:\n{tail}", file=sys.stderr, flush=True)
        say("stopping the other processes")
        code = 1
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("all processes stopped")
    return code
