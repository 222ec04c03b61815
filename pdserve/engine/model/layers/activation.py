"""The gated MLPs' activations: ``act(gate) * up`` over one fused ``[rows, 2 * inter]`` projection
(gate, then up), as HF's ``ACT2FN[hidden_act](gate_proj(x)) * up_proj(x)`` computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import layer_ops as cpu_layer_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Llama, Mistral, Qwen): ``silu(gate) * up``, one C pass where ``cpu_layer_ops``
    serves (the fused decoder layer's, ``layer_ops.c``)."""
    if cpu_layer_ops.serves(gate_up):
        return cpu_layer_ops.silu_mul(gate_up)
    size = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :size]) * gate_up[..., size:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): ``gelu(gate, approximate="tanh") * up``, HF's ``gelu_pytorch_tanh``; one C
    pass where ``cpu_layer_ops`` serves (the fused decoder layer's, ``layer_ops.c``)."""
    if cpu_layer_ops.serves(gate_up):
        return cpu_layer_ops.gelu_tanh_mul(gate_up)
    size = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :size], approximate="tanh") * gate_up[..., size:]
