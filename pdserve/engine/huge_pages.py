"""Transparent huge pages for an engine core's weights and KV cache.

A decode step of one stream reads every weight once: on a VM, where each TLB miss is a walk of
two page tables (the guest's and the host's), 4 KiB pages cost that step up to a seventh of
its time. Most distributions set transparent huge pages to ``madvise``: only memory a process
asks for gets 2 MiB pages, and neither torch's CPU allocator nor numpy asks (torch only with
``THP_MEM_ALLOC_ENABLE``, for its own allocations). glibc's ``glibc.malloc.hugetlb=1`` tunable
makes malloc ask for every heap and large block, which covers the weights whoever allocates
them, torch's and numpy's alike, and the KV cache. It must be in the environment when the
process starts, so the front sets it for the core process it spawns (``core_env``); the core
logs how much of its memory got huge pages (``resident_huge_bytes``). A model run inside the
calling process (``pdserve.LLM``, the in-process benches) gets them only if that process was
started with the tunable.

Measured on a 2-core Xeon VM (docs/performance.md, huge pages): one stream's inter-token
latency 7-15% lower in each of four pairs with the bundled model, the same resident memory
(about 810-840 MB a core, ~570 MB of it on huge pages), 8 streams no slower.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
GLIBC_TUNABLE = "glibc.malloc.hugetlb"
_SELECTED = re.compile(r"\[(\w+)\]")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "unavailable"
    (no such file: another kernel, or THP built out)."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    match = _SELECTED.search(text)
    return match.group(1) if match else "unavailable"


def core_env(
    enabled: bool, environ: Mapping[str, str] = os.environ, mode: str | None = None
) -> dict[str, str]:
    """What to add to a core process's environment for huge pages: ``GLIBC_TUNABLES`` with
    ``glibc.malloc.hugetlb=1`` appended to the tunables already set (empty when disabled, when
    the kernel gives no huge pages on request, or when the user set that tunable already: their
    choice stands)."""
    if not enabled or (mode or thp_mode()) not in ("madvise", "always"):
        return {}
    tunables = environ.get("GLIBC_TUNABLES", "")
    names = {item.partition("=")[0] for item in tunables.split(":") if item}
    if GLIBC_TUNABLE in names:
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{GLIBC_TUNABLE}=1"]))}


def resident_huge_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(bytes of anonymous memory on huge pages, resident bytes) of a process; (0, 0) where
    ``/proc`` does not say."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "AnonHugePages"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("AnonHugePages", 0), fields.get("Rss", 0)
