"""CPU placement: every engine runs as many torch threads as CPUs it may use, ``pdserve
cluster`` gives each engine's core process cores of its own (its front runs anywhere), and
``--dtype auto`` follows the CPU's bf16.

The end-to-end test starts the real ``pdserve cluster`` command and reads what the kernel says
about every process and thread of it (``/proc``), and what each engine reports over gRPC.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.cluster import plan_engine_cpus, split_cpus
from pdserve.engine.cpu_resources import (
    CpuBudget,
    cgroup_cpu_quota,
    cpu_flags,
    format_cpu_list,
    has_native_bf16,
    parse_cpu_list,
    resolve_dtype,
)
from pdserve.v1 import engine_pb2, engine_pb2_grpc

TINY_ENGINE_ARGS = ["--num-blocks", "64", "--max-model-len", "256", "--max-num-batched-tokens", "256"]


# ---------------------------------------------------------------------- cpu lists and quotas


def test_cpu_lists_parse_and_format_like_the_kernels_cpulist():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list(" 2 , 0-1 ") == [0, 1, 2]
    assert format_cpu_list([0, 1, 2, 3, 6]) == "0-3,6"
    assert format_cpu_list({4}) == "4"
    for bad in ("", "a", "3-1", "-1", "0-x"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path):
    _write(tmp_path / "proc_cgroup", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path / "cg/kubepods/cpu.max", "max 100000\n")
    _write(tmp_path / "cg/kubepods/pod1/cpu.max", "250000 100000\n")
    _write(tmp_path / "cg/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc_cgroup") == 2.5
    _write(tmp_path / "cg/kubepods/pod1/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc_cgroup") is None


def test_cgroup_v1_quota_reads_cfs_quota_and_period(tmp_path):
    _write(tmp_path / "proc_cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc_cgroup") == 1.5
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "cg", tmp_path / "proc_cgroup") is None


def test_usable_cpus_are_the_smaller_of_affinity_and_quota():
    assert CpuBudget([0, 1, 2, 3], None).usable == 4
    assert CpuBudget([0, 1, 2, 3], 1.5).usable == 2  # a fraction of a core still gets a thread
    assert CpuBudget([0, 1, 2, 3], 2.0).usable == 2
    assert CpuBudget([3], 8.0).usable == 1
    assert CpuBudget([0, 1], 0.25).usable == 1


# ---------------------------------------------------------------------- the split


def test_engines_split_the_cores_and_decode_gets_the_odd_one():
    assert plan_engine_cpus([0, 1], 1, 1) == {"prefill-0": [0], "decode-0": [1]}
    assert plan_engine_cpus([0, 1, 2, 3], 1, 1) == {"prefill-0": [0, 1], "decode-0": [2, 3]}
    assert plan_engine_cpus([0, 1, 2], 1, 1) == {"prefill-0": [0], "decode-0": [1, 2]}
    assert plan_engine_cpus([4, 5, 6, 7], 0, 2) == {"decode-0": [4, 5], "decode-1": [6, 7]}
    # More engines than cores: one core each, shared round robin.
    assert plan_engine_cpus([0, 1], 2, 2) == {
        "prefill-0": [0],
        "prefill-1": [1],
        "decode-0": [0],
        "decode-1": [1],
    }
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3, 4]]


def test_cpus_given_per_role_override_the_split():
    plan = plan_engine_cpus([0, 1, 2, 3], 1, 2, {"decode": [1, 2, 3]})
    assert plan == {"decode-0": [1], "decode-1": [2, 3], "prefill-0": [0]}
    with pytest.raises(ValueError, match="may not use"):
        plan_engine_cpus([0, 1], 1, 1, {"prefill": [7]})


# ---------------------------------------------------------------------- dtype auto


def test_dtype_auto_picks_bf16_only_where_the_cpu_has_it_natively():
    assert resolve_dtype("auto", frozenset({"avx2", "avx512f", "avx512_bf16"})) == "bfloat16"
    assert resolve_dtype("auto", frozenset({"avx2", "amx_bf16", "amx_tile"})) == "bfloat16"
    assert resolve_dtype("auto", frozenset({"fp", "asimd", "bf16"})) == "bfloat16"  # Arm
    assert resolve_dtype("auto", frozenset({"avx2", "avx512f", "avx512_vnni"})) == "float32"
    assert resolve_dtype("auto", frozenset()) == "float32"
    assert resolve_dtype("float32", frozenset({"avx512_bf16"})) == "float32"
    assert resolve_dtype("bfloat16", frozenset()) == "bfloat16"
    # This machine: whatever /proc/cpuinfo says decides.
    expected = "bfloat16" if has_native_bf16(cpu_flags()) else "float32"
    assert resolve_dtype("auto") == expected


# ---------------------------------------------------------------------- the real command


def _proc_status(pid: int, field: str, tid: int | None = None) -> str:
    path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
    for line in Path(path).read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    raise KeyError(field)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _own_thread_affinities(pid: int) -> dict[int, set[int]]:
    """{thread id: its affinity} for the threads of ``pid`` alone (not its children)."""
    out: dict[int, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            out[int(task.name)] = set(parse_cpu_list(_proc_status(pid, "Cpus_allowed_list", int(task.name))))
    return out


def _thread_affinities(pid: int) -> dict[int, set[int]]:
    """{thread id: its affinity} for every thread of ``pid`` and of its descendants."""
    out: dict[int, set[int]] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").iterdir():
            tid = int(task.name)
            try:
                out[tid] = set(parse_cpu_list(_proc_status(current, "Cpus_allowed_list", tid)))
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
        todo += _children(current)
    return out


def _engine_info(address: str) -> engine_pb2.EngineInfo:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=10)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cpus to place 2 engines")
@pytest.mark.parametrize("lending", [True, False], ids=["lending", "no-lending"])
def test_cluster_places_each_engine_on_cores_of_its_own_with_one_thread_per_core(
    tiny_model_dir, tmp_path, lending
):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # Run the command on exactly 2 cores (as on the 2-core box the defaults are made for).
    cpu_set = ",".join(map(str, cpus))
    pin_then_exec = (
        f"import os, sys; os.sched_setaffinity(0, {{{cpu_set}}}); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    # The engines size their threads themselves, and take the default dtype (auto).
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PDSERVE_DTYPE")}
    proc = subprocess.Popen(
        [sys.executable, "-c", pin_then_exec, "-m", "pdserve", "cluster", "--model", tiny_model_dir,
         "--kv-transport", "tcp", "--engine-args", " ".join(TINY_ENGINE_ARGS), "--log-dir", str(tmp_path),
         *([] if lending else ["--no-cpu-lending"])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True
    ).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            seen.append(line)
            if "pdserve cluster ready" in line:
                break
        output = "".join(seen)
        assert "pdserve cluster ready" in output, output
        rows = {
            m.group(1): (m.group(2), int(m.group(3)), m.group(4))
            for m in re.finditer(r"^(\S+-\d|router)\s+\S+\s+(\S+)\s+\S+\s+(\d+)\s+(\S+)$", output, re.M)
        }
        assert set(rows) == {"prefill-0", "decode-0", "router"}, output
        assert rows["prefill-0"][2] == str(cpus[0]) and rows["decode-0"][2] == str(cpus[1]), output
        assert rows["router"][2] == "any", output

        affinities = {name: _thread_affinities(pid) for name, (_, pid, _) in rows.items()}
        fronts = {name: _own_thread_affinities(pid) for name, (_, pid, _) in rows.items()}
        cores = {name: {tid: mask for tid, mask in affinities[name].items() if tid not in fronts[name]}
                 for name in ("prefill-0", "decode-0")}  # fmt: skip
        assert cores["prefill-0"] and cores["decode-0"], affinities
        core_pids = {name: next(iter(_children(rows[name][1]))) for name in ("prefill-0", "decode-0")}
        for name, own in (("prefill-0", cpus[0]), ("decode-0", cpus[1])):
            # The core's main thread (its steps) stays on its engine's core either way.
            assert cores[name][core_pids[name]] == {own}, cores[name]
            if lending:
                # Its torch pool may also run on the other engine's core (while that is idle);
                # every other thread started later (ZMQ, transfers) inherits the main's core.
                assert all(mask <= set(cpus) for mask in cores[name].values()), cores[name]
                assert any(mask == set(cpus) for mask in cores[name].values()), cores[name]
            else:
                # Every thread of an engine's core process (the steps, torch's pool, ZMQ) stays
                # on its engine's core.
                assert set().union(*cores[name].values()) == {own}, cores[name]
        # The fronts (gRPC, streaming) run anywhere, like the router.
        for name in ("prefill-0", "decode-0", "router"):
            assert all(set(cpus) <= mask for mask in fronts[name].values()), (name, fronts[name])

        for name, want in (("prefill-0", cpus[0]), ("decode-0", cpus[1])):
            info = _engine_info(rows[name][0])
            assert info.cpus == str(want), info
            assert info.torch_threads == 1, info  # one core: one thread, not one per machine core
            assert info.dtype == resolve_dtype("auto"), info
        logs = (tmp_path / "decode-0.log").read_text()
        assert re.search(rf"torch threads: 1 \(from the cpus it may use: cpus {cpus[1]} ", logs), logs
        lent = re.search(r"cpu lending: own cpus \[(\d+)\], may borrow \[(\d+)\]", logs)
        assert (lent is not None) == lending, logs
        if lending:
            assert lent is not None and (int(lent.group(1)), int(lent.group(2))) == (cpus[1], cpus[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
