"""The decoder's projections as the CPU engine runs them: oneDNN on weights reordered once.

A decode step reads every weight once, so its speed is how fast the matmuls stream weights
from memory. ``F.linear`` on a plain ``[out, in]`` bf16 weight reaches about a third of the
memory bandwidth at 1-8 rows here (26 ms for SmolLM2-135M's 30 layers at one row on one core,
against a 26 GB/s ``sum()``); oneDNN's own blocked layout, made once at load with
``mkldnn._reorder_linear_weight`` and used through ``mkldnn._linear_pointwise`` (what
inductor's CPU backend emits for a frozen linear, and what vLLM-CPU's oneDNN GEMMs do), takes
16.5 ms at one row and 17.4 ms at eight, with bit-identical bf16 results (same oneDNN
accumulation order). fp32 would gain too but rounds differently from MKL's sgemm, which the
exact-equivalence tests against transformers rely on, so fp32 keeps ``F.linear``.

Only the execution changes: the packed module holds the reordered weight instead of a
``Parameter``, so pack a model to serve it (``ModelRunner`` does, through
``weights.pack_linear_weights``), not one whose state dict is still needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN may tune the layout for; results are valid (and equal) for any rows.
PACK_BATCH_HINT = 8


def can_pack(dtype: torch.dtype) -> bool:
    """True where oneDNN-packed bf16 linears are available: a CPU torch built with mkldnn, on
    a CPU whose instructions oneDNN's bf16 path needs (AVX512BW/VL/DQ or AVX-NE-CONVERT). An
    AVX2-only CPU (``--dtype bfloat16`` asked for explicitly) keeps ``F.linear``: oneDNN refuses
    to reorder the weight there."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [rows, in]`` against ``pack_weight(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight (no ``weight`` Parameter)."""

    def __init__(
        self,
        packed_weight: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.packed_weight = packed_weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """The packed version of a dense projection: its weight reordered once, its bias kept."""
        return cls(pack_weight(linear.weight), linear.in_features, linear.out_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this layer's weights (the packed one is opaque: no storage to share)."""
        return [self.packed_weight] if self.bias is None else [self.packed_weight, self.bias]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """``hidden @ weight.T`` through the packed copy when there is one."""
    if packed is not None:
        return packed_linear(hidden, packed)
    return F.linear(hidden, weight)
