"""Helpers for end-to-end tests through a LocalCluster (router + engines as processes)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from tests.helpers.processes import children_of

# Engines sized like the session's colocated `tiny_llm`, so greedy outputs can be compared.
TINY_ENGINE_ARGS = ["--max-model-len", "1024", "--num-blocks", "256", "--max-num-batched-tokens", "1024"]
# For tests that kill an engine while it decodes: as long an answer as the tiny model's 4096
# positions allow (~3 s of decoding), because a loaded CI machine has let whole 900-token
# answers (0.4 s) finish between a stream's first tokens and the kill.
LONG_ANSWER_MAX_MODEL_LEN = 4096
LONG_ANSWER_ENGINE_ARGS = [
    "--max-model-len",
    str(LONG_ANSWER_MAX_MODEL_LEN),
    "--num-blocks",
    "300",
    "--max-num-batched-tokens",
    "1024",
]


def is_idle(engine: dict[str, Any]) -> bool:
    """Healthy, nothing scheduled, no block referenced by a request, none held for a decode."""
    return (
        engine["healthy"]
        and engine["kv_usage"] == 0.0
        and engine["num_held_blocks"] == 0
        and engine["num_running"] == 0
        and engine["num_waiting"] == 0
        and engine["num_waiting_for_remote_kvs"] == 0
    )


def wait_idle(client, timeout_s: float = 20.0, roles: tuple[str, ...] = ("prefill", "decode")) -> list[dict]:
    """Router Stats once every engine of ``roles`` is idle; the last stats seen at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s for s in client.stats() if s["role"] in roles]
        if all(is_idle(s) for s in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def next_within(iterator: Iterator, timeout_s: float):
    """``next(iterator)``, or TimeoutError if nothing arrives in time (the call is left running)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(next, iterator).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"nothing arrived within {timeout_s:.0f}s") from None
    finally:
        pool.shutdown(wait=False)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP a process and its children for the duration of the block: an engine's front
    and its core, which serves the router's framed session itself (it answers nothing
    meanwhile)."""
    os.kill(pid, signal.SIGSTOP)  # first: it starts no child meanwhile
    pids = [pid, *children_of(pid)]
    for each in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGSTOP)
    try:
        yield
    finally:
        for each in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGCONT)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it has exited all the same.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    return False
