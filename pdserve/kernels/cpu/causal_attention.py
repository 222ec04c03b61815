"""Causal attention of a prompt chunk over its cached prefix and itself in bf16 on the CPU (``kernels/cpu/csrc/causal_attention.c``).

A prefill chunk with no cached prefix attends to itself only; the reference hands it to torch's
SDPA (``reference.causal_self_attention_ref``), whose CPU flash kernel ran a 256-token prompt
of SmolLM2-135M at ~40 GFLOP/s, 29% of a bf16 prefill on one core. A later chunk of a long
prompt attends to the prefix gathered from the paged cache too, which SDPA took with an explicit
mask: on one Zen 5 core SmolLM2-135M prefilled 1536 tokens at 820 tok/s, 2048 at 680, against
2000 for 256 (the prompt's second 512 tokens cost 2.6x its first). The C kernel computes both
products with AVX512-BF16 dot products on K and V packed once per call, rounding as SDPA's flash
kernel does for bf16. ``serves`` says where it runs: bf16 on a CPU with AVX512-BF16, head_dim a
multiple of 32 up to 128; the reference runs everything else. A sliding window (``sliding_window``:
row ``i`` sees keys ``i - W < j <= i``) skips the tiles of keys before each pass's window, so a
long prompt costs ``O(L W)``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.cpu.build import CLibrary
from pdserve.kernels.reference import window_size


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_causal_attention_bf16.argtypes = [
        ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, ptr, i64, cint,
    ]  # fmt: skip
    lib.pd_causal_attention_bf16.restype = cint


KERNELS = CLibrary(("causal_attention",), _declare, "causal prefill attention")
NOT_HERE = -2  # the C side's "does not run here": no AVX512-BF16, or a head_dim it does not take


@functools.cache
def _runs_here(head_dim: int) -> bool:
    """Asked once per head_dim with an empty call: the library a process loads does not change."""
    if not KERNELS.available():
        return False
    empty = torch.empty(0, dtype=torch.bfloat16)
    status = KERNELS.load().pd_causal_attention_bf16(
        empty.data_ptr(),
        0,
        empty.data_ptr(),
        0,
        empty.data_ptr(),
        0,
        0,
        0,
        1,
        1,
        head_dim,
        1.0,
        0,
        empty.data_ptr(),
        0,
        1,
    )
    return status != NOT_HERE


def _rows_ok(t: torch.Tensor) -> bool:
    """[L, heads, head_dim] with each row's heads contiguous (rows may lie further apart)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True when the C kernel runs this chunk's attention (see the module docstring)."""
    return (
        query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and all(_rows_ok(t) for t in (query, key, value))
        and key.shape == value.shape
        and query.shape[0] <= key.shape[0]
        and query.shape[2] == key.shape[2]
        and key.shape[1] > 0
        and query.shape[1] % key.shape[1] == 0
        and _runs_here(query.shape[2])
    )


def causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim] bf16: the queries at the last q_len positions
    key: torch.Tensor,  # [length, num_kv_heads, head_dim] bf16: K of positions 0..length-1
    value: torch.Tensor,  # [length, num_kv_heads, head_dim] bf16
    scale: float,
    *,
    sliding_window: int | None = None,  # W: position i sees keys i - W < j <= i; None or 0: all
) -> torch.Tensor:  # [q_len, num_heads, head_dim] bf16
    """``reference.causal_self_attention_ref``'s result (q_len = length: a chunk with no cached
    prefix) or the masked SDPA of ``reference.paged_attention_prefill_ref`` (a chunk after its
    cached prefix), from the C kernel (``serves`` first)."""
    window = window_size(sliding_window)
    q_len, num_heads, head_dim = query.shape
    length = key.shape[0]
    out = torch.empty(q_len, num_heads, head_dim, dtype=torch.bfloat16)
    status = KERNELS.load().pd_causal_attention_bf16(
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        q_len,
        length,
        num_heads,
        key.shape[1],
        head_dim,
        scale,
        window,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == -1:
        raise MemoryError("causal attention: its buffers could not be allocated")
    if status != 0:
        raise ValueError(f"causal attention does not run {tuple(query.shape)} here (status {status})")
    return out
