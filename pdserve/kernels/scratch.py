"""Grow-only scratch buffers for the torch reference kernels' largest temporaries.

The CPU decode step gathers every running sequence's K and V out of the paged cache, once per
layer: around 100 MB per layer with 200 sequences of a few hundred tokens. A fresh tensor that
large comes from ``mmap`` and goes back on free, so each gather first page-faults its whole
output in; reusing one buffer made that gather 5x faster (118 MB: ~90 ms fresh vs ~16-30 ms
into a warm buffer, one thread). A buffer is only ever used inside the call that takes it: it
is overwritten by the next call, so nothing that escapes a kernel may alias it.

Buffers are per thread (two engines in one process never share one) and keep their largest
size, which is the largest gather the engine has needed so far.
"""

from __future__ import annotations

import math
import threading

import torch

_GROWTH = 1.25  # headroom on growth, so contexts growing a block at a time rarely reallocate
_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` backed by this thread's buffer ``name`` (contents undefined)."""
    # {(name, dtype, device): flat buffer}
    buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = _local.__dict__.setdefault(
        "buffers", {}
    )
    numel = math.prod(shape)
    key = (name, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # A normal tensor even when first asked for under inference_mode: an inference tensor
        # could not be written outside it (tests and benchmarks call the kernels bare).
        with torch.inference_mode(False):
            buffer = torch.empty(int(numel * _GROWTH) + 1, dtype=dtype, device=device)
        buffers[key] = buffer
    return buffer[:numel].view(shape)
