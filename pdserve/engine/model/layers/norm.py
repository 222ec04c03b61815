"""RMSNorm as HF's Llama computes it, one C call where ``cpu_layer_ops`` serves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import layer_ops as cpu_layer_ops


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalise in float32, round to the input dtype, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu_layer_ops.serves(x):
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps)[1]  # one C call (layer_ops.c)
        if x.dtype == torch.float32:
            # One fused op, bit-identical to the float32 formula below.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Rounding before the scale is what HF does in half precision; keep it to match greedy
        # output. The fp32 part is the fused op above (one call instead of five per norm).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))``: a residual add and the norm after it, one C call
        where ``cpu_layer_ops`` serves (vLLM's fused_add_rms_norm), else the two torch ops."""
        if x.dtype == delta.dtype == self.weight.dtype and cpu_layer_ops.serves(x):
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps, delta=delta)
        summed = x + delta
        return summed, self(summed)
