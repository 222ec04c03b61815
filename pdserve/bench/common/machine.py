"""What a benchmark records of the machine it ran on: the CPU and the flags its kernels' speed
depends on, the cores this process may use, the memory, and the code's git commit.

A number is only as good as the machine it was taken on: ``pdserve bench peers`` and ``pdserve
bench routing`` put ``machine_info()`` in their JSON (peers ``machine_line()`` in its tables too).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from typing import Any

# What the kernels' speed depends on: AVX2 / AVX-512 routes, native bf16 and int8 dot products.
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)


def machine_info() -> dict[str, Any]:
    """The CPU (model, the flags that matter to bf16/int8 matmuls), the cores this process may
    use, memory and load."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"},
                             timeout=10, check=False).stdout  # fmt: skip
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = set(fields.get("Flags", "").split())
    if not flags:
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "flags:")
            flags = set(line.split(":", 1)[1].split())
    mem_gib = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    return {
        "cpu_model": fields.get("Model name") or platform.processor() or "unknown",
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "amx": any(flag.startswith("amx") for flag in flags),
        "mem_total_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line of ``machine_info()`` for a table's title: the CPU, its cores, its matmul flags."""
    present = [
        flag for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni") if machine["cpu_flags"].get(flag)
    ]
    present.append("amx" if machine["amx"] else "no amx")
    return f"{machine['cpu_model']}, nproc {machine['nproc']}, {' '.join(present)}"


def git_commit() -> str | None:
    """``git describe --always --dirty`` of the checkout pdserve runs from (None outside one)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=False)  # fmt: skip
        return out.stdout.strip() or None
    return None
