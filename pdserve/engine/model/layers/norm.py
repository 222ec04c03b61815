"""RMSNorm as HF's Llama computes it (one C call where ``cpu_layer_ops`` serves), Gemma's
``x * (1 + w)`` variant, and the qk-norm that normalises each query and key head (Qwen3, Gemma 3)."""

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


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma3RMSNorm: normalise and scale by ``1 + weight`` in float32, then round to the
    input dtype (Llama rounds before the scale). ``weight`` is HF's (0 means identity); a GGUF
    file stores ``1 + weight``, which its loader takes back as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight = nn.Parameter(torch.zeros(size))

    def scale(self) -> torch.Tensor:
        """``1 + weight`` in float32: what multiplies the normed value (the fused layer's weight)."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_layer_ops.serves(x):  # fp32 or bf16: one C call (layer_ops.c), the product rounded once
            return cpu_layer_ops.rms_norm(x, self.scale(), self.eps)[1]
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))``, one C call where ``cpu_layer_ops`` serves."""
        if x.dtype == delta.dtype and cpu_layer_ops.serves(x):
            return cpu_layer_ops.rms_norm(x, self.scale(), self.eps, delta=delta)
        summed = x + delta
        return summed, self(summed)


def norm_qk_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: nn.Module, k_norm: nn.Module
) -> None:
    """qk-norm: ``q_norm`` over each query head and ``k_norm`` over each key head of ``qkv``
    (``[T, heads + 2 * kv_heads, head_dim]``: q, k, v heads), in place, before RoPE; v as it is."""
    end_k = num_heads + num_kv_heads
    # Each part contiguous, so that a decode batch takes the C norm as the fused layer does.
    qkv[:, :num_heads] = q_norm(qkv[:, :num_heads].contiguous())
    qkv[:, num_heads:end_k] = k_norm(qkv[:, num_heads:end_k].contiguous())
