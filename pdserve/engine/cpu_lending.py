"""Engines on one machine lend each other their cores while they are idle.

``pdserve cluster`` pins each engine's core process to its own cores (``plan_engine_cpus``): on 2
cores, one prefill core and one decode core. That keeps a prefill from stalling the streams, but
it also leaves a core idle whenever its engine is: a lone stream decodes on one core while the
prefill core waits for the next prompt, and a prompt prefills on one core while the decode core
waits for its first token. A decode step is bound by reading the weights, and one core reads
them at about half the rate two do (a 1B Q4_K_M step: 27 ms on one core, 15 ms on two).

So the engines of a cluster share a small file, the *board* (``CpuBoard``): for each engine its
cores and whether it is busy. Before every step an engine runs as many torch threads as its own
cores plus the cores of every engine that is idle (``LentThreads``), and it marks itself busy
while it has work. An engine that becomes busy takes its cores back at the borrower's next step,
or within a few of its layers (the borrower checks between layers too), so a borrowed core
costs its owner at most that long. Both reading and writing are single bytes in a shared page:
nothing is locked, and a stale read costs one step's placement, never correctness.

Thread placement: the core process's main thread stays on its own cores; torch's pool threads
(OpenMP workers) may run on the own and the lendable cores, and Linux puts a woken worker on the
idle one. The pool is made after the model's load at its largest size, so every worker exists to
be placed. libgomp lets the workers beyond a smaller team exit and makes new ones from the main
thread (so on its own cores only); a team of one leaves the pool alone, so on 2 cores (teams of
1 or 2) the placement holds, and ``pdserve cluster`` lends cores only there (``MAX_LENDING_CPUS``)
until new workers are placed as they are made.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.cpu_resources import pin_threads

logger = logging.getLogger(__name__)

MAGIC = b"PDCPUBRD"
HEADER = struct.Struct("<8sII")  # magic, version, slots
VERSION = 1
SLOT_SIZE = 64  # one cache line a slot: byte 0 busy, then the cpu bitmap
MAX_CPUS = (SLOT_SIZE - 8) * 8  # bitmap bytes 8..63
BUSY_OFFSET = 0
MASK_OFFSET = 8


def _slot_offset(slot: int) -> int:
    return HEADER.size + slot * SLOT_SIZE


def create_board(path: str | os.PathLike[str], slots: Sequence[Sequence[int]]) -> None:
    """Write a board for engines whose cores are ``slots[i]`` (all idle), replacing any file there."""
    size = _slot_offset(len(slots))
    data = bytearray(size)
    HEADER.pack_into(data, 0, MAGIC, VERSION, len(slots))
    for index, cpus in enumerate(slots):
        if not cpus:
            raise ValueError(f"board slot {index} has no cpus")
        for cpu in cpus:
            if not 0 <= cpu < MAX_CPUS:
                raise ValueError(f"cpu {cpu} is outside the board's 0..{MAX_CPUS - 1}")
            data[_slot_offset(index) + MASK_OFFSET + cpu // 8] |= 1 << (cpu % 8)
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)  # engines never see a half-written board


class CpuBoard:
    """One engine's view of the board: its slot, which it marks, and the others', which it reads."""

    def __init__(self, path: str | os.PathLike[str], slot: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        magic, version, slots = HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"{path} is not a pdserve cpu board (version {VERSION})")
        if not 0 <= slot < slots:
            raise ValueError(f"cpu board slot {slot} outside 0..{slots - 1} of {path}")
        if len(self._map) < _slot_offset(slots):
            raise ValueError(f"{path} is truncated")
        self.path = str(path)
        self.slot = slot
        self.cpus = [self._cpus_of(s) for s in range(slots)]
        self._busy_at = [_slot_offset(s) + BUSY_OFFSET for s in range(slots)]
        self._others = [s for s in range(slots) if s != slot]
        # Every other engine's cores: the most this engine may ever borrow (read per step).
        self._lendable = frozenset(cpu for s in self._others for cpu in self.cpus[s]) - set(self.cpus[slot])
        self._busy = False
        self._map[self._busy_at[slot]] = 0

    def _cpus_of(self, slot: int) -> list[int]:
        start = _slot_offset(slot) + MASK_OFFSET
        mask = self._map[start : start + SLOT_SIZE - MASK_OFFSET]
        return [8 * i + bit for i, byte in enumerate(mask) for bit in range(8) if byte >> bit & 1]

    @property
    def own_cpus(self) -> list[int]:
        return self.cpus[self.slot]

    @property
    def lendable_cpus(self) -> list[int]:
        """Every other engine's cores: the most this engine may ever borrow."""
        return sorted(self._lendable)

    def set_busy(self, busy: bool) -> None:
        """Mark this engine busy (its cores are not lendable) or idle; a write only on change."""
        if busy != self._busy:
            self._map[self._busy_at[self.slot]] = int(busy)
            self._busy = busy

    def idle_cpus(self) -> list[int]:
        """The other engines' cores that no busy engine owns now (engines may share cores when
        there are more engines than cores)."""
        busy = {cpu for s in self._others if self._map[self._busy_at[s]] for cpu in self.cpus[s]}
        return sorted(self._lendable - busy)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


class LentThreads:
    """Sizes this process's torch threads to its own cores plus the idle engines' ones."""

    def __init__(self, board: CpuBoard, own_threads: int | None = None) -> None:
        import torch

        self.board = board
        self._torch = torch
        own, lendable = board.own_cpus, board.lendable_cpus
        # The engine's own thread count (configure_torch_threads: --threads, OMP_NUM_THREADS or
        # the cpus it may use), default one a core; borrowed cores add one each.
        self.own_threads = own_threads or len(own)
        # Make the pool at its largest now, so every worker exists to be allowed onto the other
        # cores; the main thread (and what it starts later) stays on the own ones.
        torch.set_num_threads(self.own_threads + len(lendable))
        torch.ones(1 << 20).add_(1)  # a parallel op starts the pool
        pin_threads([*own, *lendable], but_main=True)
        self.threads = 0
        self.steps_lent = 0  # steps that ran on borrowed cores, for the log
        self.apply()
        logger.info(
            "cpu lending: own cpus %s, may borrow %s while their engines are idle (board %s, slot %d)",
            own,
            lendable,
            board.path,
            board.slot,
        )

    def apply(self) -> int:
        """Set the threads for what is idle now; returns the count."""
        threads = self.own_threads + len(self.board.idle_cpus())
        if threads != self.threads:
            self._torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def begin_step(self) -> int:
        """Before a step with work: mark busy and take the idle cores."""
        self.board.set_busy(True)
        threads = self.apply()
        if threads > self.own_threads:
            self.steps_lent += 1
        return threads

    def idle(self) -> None:
        """Nothing to compute: lend this engine's cores."""
        self.board.set_busy(False)

    def close(self) -> None:
        logger.info("cpu lending: %d steps ran on lent cores", self.steps_lent)
        self.board.set_busy(False)
        self.board.close()
