"""``pdserve bench kernels``: the byte counts it reports, its CPU exit, and its GPU code path.

The GPU path (time each kernel and a copy, check each against its reference) is run here on
CPU in Triton's interpreter with a wall-clock timer, in a subprocess, so a user with a GPU is
not the first to execute it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.bench import kernels as bench
from tests.helpers.paths import REPO_ROOT


def test_kernel_bench_byte_counts_match_a_hand_count() -> None:
    model = bench.ModelShape()  # SmolLM2-135M, bf16
    loads = {w.name + w.shape: w for w in bench.kernel_calls(model, 32, 1024, 4, 512)}
    decode = loads["paged_attention_decode32 seqs x 1024 ctx"]
    kv = 32 * 1024 * 2 * 3 * 64 * 2  # K and V of every context token, 3 KV heads, bf16
    q_and_out = 32 * 2 * 9 * 64 * 2
    tables = 32 * (64 * 4 + 4)
    assert decode.bytes_moved == kv + q_and_out + tables
    gather = loads["gather_blocks64 blocks (1024 tok)"]
    assert model.block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert gather.bytes_moved == 64 * (2 * model.block_bytes + 8)
    assert decode.floor_us(1000.0, 100.0) == pytest.approx(
        decode.bytes_moved / 1000e9 * 1e6
    )  # 1000 GB/s, in us


def test_kernel_bench_without_gpu_prints_floors_and_exits_0(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out
    assert "758.9 MB" in out  # 30 layers x (decode attention + cache write) at 32 x 1024


_MEASURE = """
import argparse, json, time, torch
from pdserve.bench import kernels as bench
model = bench.ModelShape(num_layers=2, dtype="float32")
args = argparse.Namespace(batch=2, context=40, prefill_seqs=2, chunk=8)
loads = bench.kernel_calls(model, args.batch, args.context, args.prefill_seqs, args.chunk)
def timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
rows = bench._measure(model, loads, args, torch.device("cpu"), timer)
print(json.dumps(rows))
"""


def test_kernel_bench_measure_path_runs_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_KERNELS"}
    env |= {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in rows] == [
        w.name for w in bench.kernel_calls(bench.ModelShape(), 2, 40, 2, 8)
    ]
    for row in rows:
        assert row["rel err vs ref"] <= 1e-5, row
        assert row["kernel us"] > 0 and row["copy us"] > 0


def test_cpu_block_rows_are_valid_blocks_with_finite_weights() -> None:
    from pdserve.kernels.cpu import quant

    for name in bench.CPU_KINDS:
        kind = quant.BlockKind[name]
        blocks = bench.random_block_rows(name, 16, 512)
        quant.check_blocks(kind, blocks, 512)
        assert torch.isfinite(quant.dequantize_ref(kind, blocks, 512)).all(), name


def test_kernel_bench_cpu_times_each_kind_against_a_read_of_its_bytes(tmp_path, capsys) -> None:
    from pdserve.kernels.cpu import build as cpu_build

    if cpu_build.compiler() is None:
        pytest.skip("no C compiler to build the kernels")
    out = tmp_path / "kernels_cpu.json"
    argv = ["--cpu", "--kinds", "Q4_K", "Q4_1_X16", "--shapes", "attn", "--batches", "1", "2"]
    assert bench.main([*argv, "--repeats", "1", "--stream-mb", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["measured"]
    assert [(r["kind"], r["batch"]) for r in rows] == [
        ("Q4_K", 1),
        ("Q4_K", 2),
        ("Q4_1_X16", 1),
        ("Q4_1_X16", 2),
    ]
    for row in rows:
        assert row["K x N"] == "2048x2048" and row["kernel us"] > 0 and row["read us"] > 0
        assert row["kernel / read"] == pytest.approx(row["kernel us"] / row["read us"])
    assert "CPU block matmuls" in capsys.readouterr().out
