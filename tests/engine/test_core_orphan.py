"""An engine core never outlives its front: killed while its core still loads, the front leaves
no process behind (the core used to take init for its parent and idle forever, holding its
model and KV cache)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.cluster import pid_gone
from tests.helpers.processes import children_of, processes_mentioning
from tests.helpers.reliability import free_ports, serving, wait_for


def test_a_front_killed_while_its_core_starts_leaves_no_core_behind(tiny_model_dir, tmp_path):
    _, front = _start_front(tiny_model_dir, tmp_path)
    try:
        wait_for(lambda: _cores_of(front.pid), 60, "the front to spawn its core")
        (core,) = _cores_of(front.pid)
        os.kill(front.pid, signal.SIGKILL)  # the core is still importing torch or loading
        front.wait(timeout=10)
        wait_for(lambda: pid_gone(core), 60, "the core to exit")
    finally:
        if front.poll() is None:
            front.kill()
    assert "is gone" in (tmp_path / "front.log").read_text()  # the core says why it left


def test_a_front_killed_while_its_core_serves_leaves_no_core_behind(tiny_model_dir, tmp_path):
    """Killed once it serves (its core idle in its loop, the session channel open): the core
    exits too, rather than spinning on the channel the dead front closed."""
    port, front = _start_front(tiny_model_dir, tmp_path)
    try:
        wait_for(lambda: serving(f"127.0.0.1:{port}"), 120, "the engine to serve")
        (core,) = _cores_of(front.pid)
        os.kill(front.pid, signal.SIGKILL)
        front.wait(timeout=10)
        try:
            wait_for(lambda: pid_gone(core), 30, "the core to exit")
        finally:
            if not pid_gone(core):
                os.kill(core, signal.SIGKILL)  # not left spinning under the other tests
    finally:
        if front.poll() is None:
            front.kill()


def _start_front(model_dir: str, tmp_path) -> tuple[int, subprocess.Popen]:
    """A colocated engine front on a free port, its log in ``tmp_path/front.log``."""
    (port,) = free_ports(1)
    with open(tmp_path / "front.log", "wb") as log:
        front = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--model", model_dir, "--max-model-len", "64", "--num-blocks", "16"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    return port, front


def _cores_of(front: int) -> list[int]:
    cores = {int(line.split(":")[0]) for line in processes_mentioning("pdserve.engine.core_proc")}
    return [pid for pid in children_of(front) if pid in cores]
