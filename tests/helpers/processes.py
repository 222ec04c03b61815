"""What a test checks after a run: that none of its processes outlived it."""

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


def children_of(pid: int) -> list[int]:
    """Pids of the processes whose parent is ``pid`` (from /proc), zombies included."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            children.append(int(entry))
    return children
