"""What a benchmark test checks after a run: that none of its processes outlived it."""

from __future__ import annotations

import os


def processes_mentioning(marker: str) -> list[str]:
    """``"pid: cmdline"`` of every process (but this one) whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline[:200]}")
    return found
