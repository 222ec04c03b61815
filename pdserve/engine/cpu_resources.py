"""What CPU this engine runs on and how much of it it may use: threads, placement, dtype.

An engine that guesses wrong here loses most of its speed without failing:

- torch starts one intra-op thread per core of the *machine*. Two engines on a 2-core box then
  run four busy OpenMP threads on two cores and each step takes several times as long; in a
  container with a CPU limit of 2 on a 64-core node, torch starts 64 threads that the CFS quota
  throttles. So an engine takes as many threads as CPUs it may really use: its affinity mask
  and its cgroup CPU quota, whichever is smaller (``CpuBudget.usable``).
- fp32 weights read twice the bytes of bf16 on every decode step, which is bound by reading
  the weights. Where the CPU multiplies bf16 natively (AVX512-BF16, AMX, Arm's BF16), ``--dtype
  auto`` picks bf16; elsewhere bf16 is emulated and slower than fp32, so it keeps fp32
  (``resolve_dtype``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (the kernel's cpulist syntax, as taskset takes it)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            low, high = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a cpu number or range") from None
        if low < 0 or high < low:
            raise ValueError(f"cpu list {text!r}: bad range {part!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"cpu list {text!r} names no cpu")
    return sorted(cpus)


def format_cpu_list(cpus: list[int] | set[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``."""
    ranges: list[list[int]] = []  # [[first, last], ...]
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _own_cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """{controller: path} from /proc/self/cgroup; cgroup v2's unified line is under ``""``."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/a/b/c``, ``root/a/b``, ``root/a``, ``root``: a quota anywhere above us applies."""
    parts = [p for p in path.split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU bandwidth limit of this process's cgroup in CPUs (``1.5``), or None if unlimited.

    cgroup v2 keeps it in ``cpu.max`` (``"150000 100000"`` or ``"max 100000"``), v1 in
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: none). The tightest limit on the
    way up to the root counts. Inside a container the container's own cgroup is the root.
    """
    paths = _own_cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if "" in paths:  # v2
        for directory in _ancestors(root, paths[""]):
            try:
                quota, period = (directory / "cpu.max").read_text().split()[:2]
            except (OSError, ValueError):
                continue
            if quota != "max" and int(period) > 0:
                limits.append(int(quota) / int(period))
    if "cpu" in paths:  # v1 (/proc/self/cgroup names "cpu,cpuacct"; _own_cgroup_paths splits it)
        for mount in (root / "cpu", root / "cpu,cpuacct"):  # mounted alone or with cpuacct
            for directory in _ancestors(mount, paths["cpu"]):
                try:
                    quota_us = int((directory / "cpu.cfs_quota_us").read_text())
                    period_us = int((directory / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if quota_us > 0 and period_us > 0:
                    limits.append(quota_us / period_us)
    return min(limits) if limits else None


def pin_threads(cpus: list[int], *, but_main: bool = False) -> None:
    """Pin every thread this process has now to ``cpus`` (the mask is per thread), the main
    thread too unless ``but_main``; a thread that ends meanwhile is skipped."""
    main = os.getpid()
    for task in os.listdir("/proc/self/task"):
        if not (but_main and int(task) == main):
            with contextlib.suppress(ProcessLookupError, OSError):
                os.sched_setaffinity(int(task), cpus)


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs an engine may use and the thread count that follows from them."""

    cpus: list[int]  # its affinity mask
    quota: float | None  # its cgroup's CPU limit, in CPUs (None: unlimited)

    @property
    def usable(self) -> int:
        """min(affinity, ceil(quota)), at least 1: more threads than that only queue."""
        count = len(self.cpus)
        if self.quota is not None:
            count = min(count, math.ceil(self.quota - 1e-9))
        return max(1, count)

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} cpus"
        return f"cpus {format_cpu_list(self.cpus)} (cgroup quota {quota})"


def cpu_budget() -> CpuBudget:
    return CpuBudget(allowed_cpus(), cgroup_cpu_quota())


def configure_torch_threads(requested: int = 0) -> int:
    """Set torch's intra-op threads for this process and log why; returns the count.

    ``requested`` > 0 is an explicit choice (``--threads``); otherwise ``OMP_NUM_THREADS``, if
    set, is the user's; otherwise the CPUs this process may use (``CpuBudget.usable``).
    """
    import torch

    budget = cpu_budget()
    source = "--threads"
    threads = requested
    if threads <= 0:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env.isdigit() and int(env) > 0:
            threads, source = int(env), "OMP_NUM_THREADS"
        else:
            threads, source = budget.usable, "the cpus it may use"
    if threads > budget.usable:
        logger.warning(
            "%d torch threads (from %s) but only %d usable cpus: threads will queue for cores",
            threads,
            source,
            budget.usable,
        )
    torch.set_num_threads(threads)
    logger.info("torch threads: %d (from %s: %s)", threads, source, budget.describe())
    return threads


# The CPU's feature flags are read by pdserve/kernels/cpu/features.py, whose builds of the C kernels
# are keyed by them. The three functions below import it at the call: importing the kernels
# package imports torch, which this module's other users (the engine's front process, ``pdserve
# cluster``) do without.


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (``features.cpu_flags()``)."""
    from pdserve.kernels.cpu import features

    return features.cpu_flags(cpuinfo)


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU (or ``flags``) multiplies bf16 natively (``features.has_native_bf16()``)."""
    from pdserve.kernels.cpu import features

    return features.has_native_bf16(flags)


def resolve_dtype(name: str, flags: frozenset[str] | None = None) -> str:
    """``"auto"`` -> ``"bfloat16"`` where the CPU has native bf16, else ``"float32"``; any
    other name is returned as it is."""
    if name != "auto":
        return name
    from pdserve.kernels.cpu.features import native_bf16_flags

    native = native_bf16_flags(flags)
    chosen = "bfloat16" if native else "float32"
    logger.info(
        "dtype auto: %s (%s)",
        chosen,
        f"the cpu has {', '.join(native)}" if native else "no native bf16 on this cpu",
    )
    return chosen
