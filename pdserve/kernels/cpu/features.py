"""What the CPU can do, as the kernel builds and the engine's dtype choice need to know it.

``cpu_flags()`` reads the feature flags the kernel reports (``/proc/cpuinfo``): the C kernels'
build is keyed by them (``build.py``), so that a machine of another kind builds its own copy.
``has_native_bf16()`` says whether bf16 matmuls run natively here, which the engine's ``--dtype
auto`` follows (``cpu_resources.resolve_dtype()``, which imports this module). Nothing here
imports the engine.
"""

from __future__ import annotations

from pathlib import Path

# CPU flags (as /proc/cpuinfo spells them) that mean bf16 matmuls run natively: x86's AVX512-BF16
# and AMX-BF16, Arm's BF16 extension.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16_flags(flags: frozenset[str] | None = None) -> list[str]:
    """Which of ``NATIVE_BF16_FLAGS`` the CPU (or ``flags``) has."""
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool(native_bf16_flags(flags))
