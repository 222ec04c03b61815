"""Engines lend each other their cores while idle (pdserve.engine.cpu_lending)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.engine.cpu_lending import MAX_CPUS, CpuBoard, create_board


def test_a_board_shows_each_engine_the_others_idle_cores(tmp_path):
    path = tmp_path / "board"
    create_board(path, [[0], [1], [2, 3]])
    prefill, decode, other = CpuBoard(path, 0), CpuBoard(path, 1), CpuBoard(path, 2)
    assert (prefill.own_cpus, decode.own_cpus, other.own_cpus) == ([0], [1], [2, 3])
    assert decode.lendable_cpus == [0, 2, 3]
    assert decode.idle_cpus() == [0, 2, 3]  # everyone starts idle

    prefill.set_busy(True)  # another process's write, through its own mapping
    assert decode.idle_cpus() == [2, 3]
    assert other.idle_cpus() == [1]
    other.set_busy(True)
    assert decode.idle_cpus() == []
    prefill.set_busy(False)
    assert decode.idle_cpus() == [0]
    decode.set_busy(True)
    assert prefill.idle_cpus() == []  # its own cores never count


def test_a_core_shared_by_two_engines_is_lent_only_while_both_are_idle(tmp_path):
    path = tmp_path / "board"
    create_board(path, [[0], [0], [1]])  # 2 prefill engines on core 0, a decode engine on core 1
    first, second, decode = (CpuBoard(path, slot) for slot in range(3))
    assert decode.idle_cpus() == [0]
    first.set_busy(True)
    assert decode.idle_cpus() == []
    first.set_busy(False)
    second.set_busy(True)
    assert decode.idle_cpus() == []
    assert first.idle_cpus() == [1]  # its own core is never lent to itself


def test_a_board_refuses_what_it_cannot_hold(tmp_path):
    path = tmp_path / "board"
    with pytest.raises(ValueError, match="no cpus"):
        create_board(path, [[0], []])
    with pytest.raises(ValueError, match="outside the board"):
        create_board(path, [[0], [MAX_CPUS]])
    create_board(path, [[0], [1]])
    with pytest.raises(ValueError, match="slot 2 outside 0..1"):
        CpuBoard(path, 2)
    (tmp_path / "junk").write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="not a pdserve cpu board"):
        CpuBoard(tmp_path / "junk", 0)


# Runs in its own process: it sets torch's threads and its threads' affinity.
LENDER_SCRIPT = """
import json, os, sys, torch
from pdserve.engine.cpu_lending import CpuBoard, LentThreads
path, own, other = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {own})
torch.set_num_threads(1)
mine, theirs = CpuBoard(path, 1), CpuBoard(path, 0)
lent = LentThreads(mine)
seen = {"start": torch.get_num_threads()}
theirs.set_busy(True)
seen["owner_busy"] = lent.begin_step()
theirs.set_busy(False)
seen["owner_idle"] = lent.begin_step()
seen["steps_lent"] = lent.steps_lent
seen["busy_byte"] = theirs.idle_cpus()  # the borrower is marked busy while it steps
lent.idle()
seen["after_idle"] = theirs.idle_cpus()
seen["main_affinity"] = sorted(os.sched_getaffinity(0))
tasks = [int(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
seen["pool_affinities"] = sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tasks})
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cpus to lend one")
def test_an_engine_steps_on_a_lent_core_only_while_its_owner_is_idle(tmp_path):
    own, other = sorted(os.sched_getaffinity(0))[:2]
    path = tmp_path / "board"
    create_board(path, [[other], [own]])
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", LENDER_SCRIPT, str(path), str(own), str(other)],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["start"] == 2  # both idle at start: its own core and the lent one
    assert seen["owner_busy"] == 1
    assert seen["owner_idle"] == 2
    assert seen["steps_lent"] == 1
    assert seen["busy_byte"] == []
    assert seen["after_idle"] == [own]
    assert seen["main_affinity"] == [own]  # the stepping thread stays home
    assert sorted([own, other]) in [list(a) for a in seen["pool_affinities"]]  # torch's workers may roam
