"""Shared helpers for the reliability tests: processes, streams, stats, bounded waits.

A ``TestCluster`` starts each engine as its own process (``engine_launcher``: the real engine
server, plus an optional tcp fault) and any number of routers in front of any subset of
them, each on ports picked at run time. ``Proc`` is a ``pdserve.supervisor`` process that tests
can also kill -9, freeze (SIGSTOP), thaw and restart on the same address. Every wait is bounded:
a timeout is a test failure, never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from pdserve.supervisor import SupervisedProcess, check_health, pick_free_ports, terminate_all, wait_healthy
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from tests.helpers.paths import REPO_ROOT
from tests.helpers.text_corpus import long_text

HOST = "127.0.0.1"
# Short fault-handling knobs, so a whole fault plays out in a few seconds.
LEASE_MS = 2000
TRANSFER_TIMEOUT_S = 2.0
# Engines sized like the session's colocated ``tiny_llm`` (greedy outputs are compared with it).
ENGINE_ARGS = [
    "--max-model-len", "1024",
    "--num-blocks", "256",
    "--max-num-batched-tokens", "1024",
    "--kv-transport", "tcp",
    "--lease-ms", str(LEASE_MS),
    "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S),
]  # fmt: skip
# A bound for calls that must finish or fail; reaching it (DEADLINE_EXCEEDED) means a hang.
CALL_TIMEOUT_S = 60.0
# Idle within the lease: the lease, plus the engines' poll and the router's 2 s abort timeout.
IDLE_WITHIN_S = LEASE_MS / 1000 + 8.0
STARTUP_TIMEOUT_S = 300.0


def free_ports(count: int) -> list[int]:
    return pick_free_ports(HOST, count)


def serving(address: str, timeout_s: float = 0.5) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING."""
    return check_health(address, timeout_s)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll until ``predicate()`` is truthy; seconds waited. AssertionError at the timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


# ---------------------------------------------------------------------- processes


class Proc(SupervisedProcess):
    """One process of a test cluster (an engine's front, which owns its core, or a router):
    a supervised process the tests can also kill -9, freeze and restart on the same address."""

    def __init__(
        self,
        name: str,
        role: str,
        port: int,
        argv: list[str],
        log_path: str,
        env: dict[str, str],
        kv_port: int | None = None,
    ) -> None:
        super().__init__(
            name, [sys.executable, *argv], log_path, address=f"{HOST}:{port}", env=env, cwd=REPO_ROOT
        )
        self.role = role  # "prefill", "decode" or "router"
        self.port = port
        self.kv_port = kv_port  # a prefill engine's KV side-channel port
        self.metrics_port: int | None = None  # a router's Prometheus port

    def wait_serving(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_healthy([self], timeout_s)

    def group_pids(self) -> list[int]:
        """The front and everything in its process group (the engine core)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{entry}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    if int(fields[2]) == self.pid and fields[0] != "Z":
                        pids.append(int(entry))
        return pids

    def core_pids(self) -> list[int]:
        """The engine core process(es): the rest of the front's process group."""
        return [pid for pid in self.group_pids() if pid != self.pid]

    def kill9(self) -> None:
        """kill -9 of the front and its engine core at once."""
        self.signal_group(signal.SIGKILL)
        self.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP the whole engine (front and core): it answers nothing until thawed."""
        self.signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The whole engine frozen for the duration of the block."""
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    @contextlib.contextmanager
    def core_frozen(self) -> Iterator[None]:
        """SIGSTOP only the engine core: the front still answers gRPC and queues what it is
        sent (requests, aborts) for the core, which handles it when it runs again."""
        cores = self.core_pids()
        assert cores, f"{self.name} has no engine core process"
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in cores:
                os.kill(pid, signal.SIGCONT)

    def restart(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the same command again: same gRPC address, same KV side-channel port."""
        if self.alive:
            self.kill9()
        self.spawn()
        self.wait_serving(timeout_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL (of its group too) after ``grace_s``."""
        if self.alive:
            self.thaw()  # a frozen process can't exit
        self.terminate(grace_s)


class TestCluster:
    """Engines and routers as local processes, each added with its own arguments.

    ``engine()`` and ``router()`` start a process and return at once; ``wait_serving()`` waits
    for everything started so far. All engines share one cluster token unless told otherwise.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, model_dir: str, env: dict[str, str] | None = None) -> None:
        self.model_dir = model_dir
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-reliability-")
        self.token = secrets.token_hex(16)
        base = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH", "")) if p)
        # One torch thread per process: the tests run many engines on a couple of cores.
        self.env = {
            **base,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": pythonpath,
            **(env or {}),
        }
        self.procs: dict[str, Proc] = {}
        self.failed = False

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.failed = self.failed or exc_type is not None
        self.close()

    def _add(self, name: str, role: str, port: int, argv: list[str], kv_port: int | None = None) -> Proc:
        assert name not in self.procs, name
        proc = Proc(name, role, port, argv, os.path.join(self.log_dir, f"{name}.log"), self.env, kv_port)
        self.procs[name] = proc
        proc.spawn()
        return proc

    def engine(
        self,
        name: str,
        role: str,
        *,
        model: str | None = None,
        args: Sequence[str] = (),
        tcp_fault: dict[str, Any] | None = None,
        token: str | None = None,
    ) -> Proc:
        port, kv_port = free_ports(2)
        argv = ["-m", "tests.helpers.engine_launcher", "--log-level", "INFO", role]
        argv += ["--host", HOST, "--port", str(port), "--model", model or self.model_dir]
        argv += ["--engine-id", name, "--cluster-token", token or self.token, *ENGINE_ARGS]
        if role == "prefill":
            argv += ["--kv-port", str(kv_port)]  # fixed, so a restart keeps the same address
        if tcp_fault is not None:
            argv += ["--tcp-fault", json.dumps(tcp_fault)]
        return self._add(name, role, port, [*argv, *args], kv_port if role == "prefill" else None)

    def router(
        self, name: str, prefill: Sequence[Proc], decode: Sequence[Proc], args: Sequence[str] = ()
    ) -> Proc:
        port, metrics_port = free_ports(2)
        argv = ["-m", "pdserve", "--log-level", "INFO", "router", "--host", HOST, "--port", str(port)]
        argv += ["--metrics-port", str(metrics_port)]
        argv += [
            "--prefill",
            ",".join(p.address for p in prefill),
            "--decode",
            ",".join(d.address for d in decode),
        ]
        argv += ["--model", self.model_dir, *args]
        proc = self._add(name, "router", port, argv)
        proc.metrics_port = metrics_port
        return proc

    def wait_serving(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.wait_serving(max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        """The routers, then the engines: each set stopped together (SIGTERM, SIGKILL after 10 s)."""
        routers = [p for p in self.procs.values() if p.role == "router"]
        engines = [p for p in self.procs.values() if p.role != "router"]
        for group in (routers, engines):
            for proc in group:
                if proc.alive:
                    proc.thaw()  # a frozen process can't exit
            terminate_all(group, grace_s=10.0)
        if not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)


# ---------------------------------------------------------------------- stats


def engine_stats(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The engine's own Stats (asked directly, not through a router)."""
    with grpc.insecure_channel(address) as channel:
        reply = engine_pb2_grpc.EngineStub(channel).Stats(common_pb2.StatsRequest(), timeout=timeout_s)
    return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}


def is_idle(stats: dict[str, Any]) -> bool:
    """Nothing scheduled or waiting, no block referenced by a request, none held for a reader."""
    return (
        stats["kv_usage"] == 0.0
        and stats["num_held_blocks"] == 0
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["num_waiting_for_remote_kvs"] == 0
    )


def wait_idle(engines: Sequence[Proc], within_s: float = IDLE_WITHIN_S) -> dict[str, dict]:
    """Wait until every engine is idle (asked directly); their stats. AssertionError at the bound."""
    last: dict[str, dict] = {}

    def all_idle() -> bool:
        for engine in engines:
            try:
                last[engine.name] = engine_stats(engine.address)
            except grpc.RpcError as exc:
                last[engine.name] = {"error": exc.code().name}
                return False
        return all(is_idle(s) for s in last.values())

    try:
        wait_for(all_idle, within_s, "every engine to be idle", poll_s=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None
    return last


def router_health(client: Any) -> dict[str, bool]:
    """{engine address: healthy} as the router sees it."""
    return {s["address"]: bool(s["healthy"]) for s in client.stats()}


def settle(client: Any, engines: Sequence[Proc], timeout_s: float = 20.0) -> None:
    """Before a test: the router sees every engine healthy, and every engine is idle."""
    wait_for(lambda: all(router_health(client).values()), timeout_s, "the router to see every engine healthy")
    wait_idle(engines, timeout_s)


def router_in_flight(router: Proc, role: str) -> int:
    """Requests the router has sent to engines of ``role`` and not seen end (its /metrics)."""
    with urllib.request.urlopen(f"http://{HOST}:{router.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdserve_router_engine_in_flight{") and f'role="{role}"' in line
        )
    )


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------------- requests

_fresh = itertools.count()


def fresh_prompt(tokenizer: Any, num_tokens: int = 80) -> list[int]:
    """Real text no engine has seen (its first block is unique): above the disaggregation
    threshold, so the router sends it through prefill and decode must pull its KV."""
    k = next(_fresh)
    ids = tokenizer.encode(f"Case {k} of run {os.getpid()}: " + long_text(num_tokens * 6, start=k))
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def generate_request(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    request_id: str = "",
    ignore_eos: bool = True,
    **sampling: Any,
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling),
    )


class Stream:
    """A router ``Generate`` stream read by a background thread; cancellable from the test.

    ``tokens`` grows as deltas arrive; once ``done`` is set, ``finish_reason`` (a normal end)
    or ``code``/``details`` (an error status) say how it ended.
    """

    def __init__(
        self, client: Any, request: router_pb2.GenerateRequest, timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        self.request_id = request.request_id
        self.call = client.stub.Generate(request, timeout=timeout_s)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.done = threading.Event()
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._arrived:
                    self.tokens.extend(message.token_ids)
                    self.finish_reason = message.finish_reason or self.finish_reason
                    self._arrived.notify_all()
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        finally:
            self.done.set()
            with self._arrived:
                self._arrived.notify_all()

    def wait_tokens(self, count: int, timeout_s: float = 30.0) -> None:
        with self._arrived:
            ok = self._arrived.wait_for(lambda: len(self.tokens) >= count or self.done.is_set(), timeout_s)
        assert ok and len(self.tokens) >= count, (
            f"{self.request_id}: {len(self.tokens)} of {count} tokens after {timeout_s}s "
            f"(finish_reason={self.finish_reason}, code={self.code}, {self.details!r})"
        )

    def wait_done(self, timeout_s: float = 30.0) -> Stream:
        assert self.done.wait(timeout_s), f"{self.request_id}: still streaming after {timeout_s}s"
        return self

    def cancel(self) -> None:
        """The client goes away without an Abort: the router sees the call cancelled."""
        self.call.cancel()

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort" or self.code == grpc.StatusCode.CANCELLED


def engine_prefill(address: str, request_id: str, prompt: Sequence[int]) -> engine_pb2.EngineGenerateResponse:
    """Ask a prefill engine directly for a first token held for a remote decode; its last
    message (with the ``kv_transfer_params`` a decode engine would use)."""
    request = engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
        kv_transfer_params=common_pb2.KVTransferParams(do_remote_decode=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        last = None
        for message in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            last = message
        # The blocks are held for a decode that will never come: free them now.
        stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=5.0)
    assert last is not None and last.kv_transfer_params.do_remote_prefill, last
    return last
