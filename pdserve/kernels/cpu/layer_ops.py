"""RMSNorm, RoPE and the KV write as one C call each on the CPU (``kernels/cpu/csrc/layer_ops.c``).

A decode step of SmolLM2-135M at one sequence runs 61 RMSNorms and 30 RoPE + KV writes on
tensors of a few hundred values, where each torch op costs its dispatch, not its arithmetic:
torch's fp32 ``rms_norm`` alone is eight ops, about 100 us a norm on the AMD EPYC (Zen 3) here,
6 ms of a step. Each op here is one ``ctypes`` call on the tensors' data pointers.

The results are the torch path's (``norm.RMSNorm``, ``rotary.apply_rope`` and
``reference.reshape_and_cache_ref``) bit for bit, except fp32 RMSNorm, whose sum of squares runs
in another order than torch's (whose lanes depend on the CPU), so its scale may differ by a
rounding (tested). Where the library cannot be built, or the tensors are not CPU fp32/bf16
ones, ``serves`` is False and the model keeps its torch ops; ``PDSERVE_KERNELS`` set to
``torch`` or ``triton`` keeps them too.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve import kernels
from pdserve.kernels.cpu.build import CLibrary

MAX_DIM = 16384  # the C side's MAX_DIM: a hidden size or head_dim it takes


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, cint, cint]
    lib.pd_rms_norm.restype = None
    lib.pd_rope_and_cache.argtypes = [ptr, cint, i64, i64, i64, i64, ptr, ptr, ptr, cint, ptr, i64, i64, i64]
    lib.pd_rope_and_cache.restype = None
    lib.pd_silu_mul.argtypes = [ptr, ptr, i64, i64, cint]
    lib.pd_silu_mul.restype = None
    lib.pd_gelu_tanh_mul.argtypes = [ptr, ptr, i64, i64, cint]
    lib.pd_gelu_tanh_mul.restype = None


KERNELS = CLibrary(("layer_ops",), _declare, "layer ops (RMSNorm, RoPE, KV write, SiLU / GELU x up)")


def serves(x: torch.Tensor) -> bool:
    """True when the C ops take ``x``: a contiguous fp32 or bf16 CPU tensor, rows no wider than
    ``MAX_DIM``, the library built here, and no kernel backend forced (``PDSERVE_KERNELS``)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and x.shape[-1] <= MAX_DIM
        and kernels.forced_backend() not in ("torch", "triton")
        and KERNELS.available()
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, weight * norm(s))`` with ``s = x`` or, given ``delta``, ``s = x + delta`` (a new
    tensor); rows are the last dimension. ``x`` and ``delta`` share a dtype; ``weight`` has it
    too (Llama's form: the normed value rounded to it first), or is float32 (Gemma's: the product
    rounded once)."""
    weight_f32 = weight.dtype == torch.float32
    if (weight.dtype != x.dtype and not weight_f32) or (
        delta is not None and (delta.dtype != x.dtype or delta.shape != x.shape)
    ):
        raise ValueError(
            f"rms_norm: x {x.dtype}, weight {weight.dtype}, delta {None if delta is None else delta.dtype}"
        )
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty_like(x)
    summed = x if delta is None else torch.empty_like(x)
    if delta is not None:
        delta = delta.contiguous()
    weight = weight.contiguous()
    KERNELS.load().pd_rms_norm(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        summed.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
        int(weight_f32),
    )
    return summed, out


def rope_and_cache(
    qkv: torch.Tensor,  # [T, heads + 2 * kv_heads, head_dim], contiguous: rotated in place
    num_heads: int,
    cos: torch.Tensor,  # [T, 1, head_dim] (or [T, head_dim]), qkv's dtype
    sin_signed: torch.Tensor,
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, negative: not written
) -> None:
    """RoPE on the q and k heads of ``qkv`` in place, then its k and v heads into their slots."""
    num_tokens, width, head_dim = qkv.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache_layer.shape
    if (
        width != num_heads + 2 * num_kv_heads
        or cache_head_dim != head_dim
        or not kv_cache_layer[0].is_contiguous()
    ):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit the cache {tuple(kv_cache_layer.shape)}")
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    KERNELS.load().pd_rope_and_cache(
        qkv.data_ptr(),
        int(qkv.dtype == torch.bfloat16),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin_signed.data_ptr(),
        kv_cache_layer.data_ptr(),
        int(kv_cache_layer.dtype == torch.bfloat16),
        slots.data_ptr(),
        block_size,
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up`` = ``[rows, 2 * inter]`` (gate, then up), rounded as torch
    rounds them, with layer_ops.c's exp (the fused decoder layer's, so that both paths agree)."""
    return _gated(gate_up, "silu_mul")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` for ``gate_up`` = ``[rows, 2 * inter]`` (Gemma's
    GeGLU), rounded as torch rounds them, with layer_ops.c's exp (the fused decoder layer's)."""
    return _gated(gate_up, "gelu_tanh_mul")


def _gated(gate_up: torch.Tensor, name: str) -> torch.Tensor:
    """``act(gate) * up`` by layer_ops.c's ``pd_<name>`` over ``gate_up`` ``[rows, 2 * inter]``."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"{name}: gate_up width {width} is not gate + up")
    gate_up = gate_up.contiguous()
    act = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    getattr(KERNELS.load(), f"pd_{name}")(
        gate_up.data_ptr(), act.data_ptr(), rows, width // 2, int(gate_up.dtype == torch.bfloat16)
    )
    return act
