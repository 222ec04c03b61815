"""Weight-only quantized projections, embedding and LM head (``--quantization gguf | int8``).

A decode step at small batch reads every weight once, so its time is the weights' bytes over
the memory bandwidth. Kept as GGUF blocks, SmolLM2-135M's layers stream 5 bits a weight (Q4_1)
instead of bf16's 16. The modules here hold the blocks (``pdserve.kernels.cpu.quant``) and
leave activations in the model's dtype:

* up to ``KERNEL_MAX_ROWS`` rows (decode batches) the C kernel decodes blocks in registers;
* more rows (prefill chunks) are compute-bound, so the blocks are decoded once to the
  activations' dtype and multiplied by torch's GEMM, whose arithmetic outruns the kernel's.

``--quantization gguf-a8 / int8-a8`` (``QuantLinear.use_int8_activations``) opts in to one more rounding:
the kernel's x quantized to int8 per block of 32, as llama.cpp does, whose integer dots need a
fraction of the fp32 arithmetic (``kernels/cpu/csrc/quants_a8.c``). Where the CPU has
AVX512-VNNI the weights are interleaved (``kernels/cpu/csrc/repack_a8.c``) and prefill chunks run that
kernel too, as llama.cpp's prompt processing does: one vpdpbusd is 64 multiply-adds where
vdpbf16ps is 32, so SmolLM2-135M's layers took 90 ms of a 256-token prompt instead of 125
(decode + bf16 GEMM, one Zen 5 core); a 1B model's Q4_K matrices, about as fast either way
(8.1 against 9.5 ms for 256 x 2048 x 4096). A projection whose parts are of both sorts (a Q6_K
v beside Q4_K q and k) runs each part its own way. Elsewhere prefill chunks decode the blocks as
above. What it costs in quality is measured in tests/engine/model/test_quality_quant.py.

The tied embedding and LM head share one block tensor, counted once. The walks over a whole
model that make and prepare these modules at load are in ``weights.py``; each calls the
module's own method (``from_linear``, ``use_int8_activations``, ``interleave``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind
from pdserve.kernels.scratch import scratch

# The blocks already interleaved at this load, by the row-major blocks' data pointer: a table
# shared by the tied embedding and LM head is interleaved once and stays shared.
Interleaved = dict[int, tuple[BlockKind, torch.Tensor]]

# Rows up to which the kernel beats decode-then-GEMM (measured with ``pdserve bench step``).
KERNEL_MAX_ROWS = 16


def _decode(
    kind: BlockKind,
    blocks: torch.Tensor,
    in_features: int,
    dtype: torch.dtype,
    use_kernel: bool,
    rows: torch.Tensor | None = None,
    reuse: bool = False,
) -> torch.Tensor:
    """``W[rows]`` (every row when None) in ``dtype``: the C decoder, or the torch reference.
    ``reuse``: the whole matrix into this thread's scratch buffer, valid until the next such call
    (for a weight that lives only inside one GEMM); SmolLM2's 120 layer matrices decoded to bf16
    took 85 ms into fresh tensors (page faults), 12 ms into the buffer, one Zen 5 core."""
    if use_kernel:
        out = None
        if reuse and rows is None:
            out = scratch("dequantized_weight", (blocks.shape[0], in_features), dtype, blocks.device)
        return cpu_quant.quant_dequantize(kind, blocks, in_features, dtype, rows=rows, out=out)
    held = blocks if rows is None else blocks[rows]
    return cpu_quant.dequantize_ref(kind, held, in_features).to(dtype)


class QuantLinear(nn.Module):
    """``nn.Linear``'s forward over a weight held as GGUF blocks.

    The weight's output rows are one part or several (``from_parts``), each blocks of its own
    kind, in order: llama.cpp's "_M" files keep a layer's v in Q6_K and its q and k in Q4_K, so
    a fused q/k/v is two parts, each read as the file holds it (buffers ``blocks``,
    ``blocks_1``, ...)."""

    blocks: torch.Tensor

    def __init__(
        self, kind: BlockKind, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = 0  # the parts' rows, kept as they are added (forward reads it each call)
        self.kinds: list[BlockKind] = []
        self._add_part(kind, blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = cpu_quant.available()
        self.int8_activations = False  # use_int8_activations

    def _add_part(self, kind: BlockKind, blocks: torch.Tensor) -> None:
        blocks = blocks.contiguous()
        cpu_quant.check_blocks(kind, blocks, self.in_features)  # once: forward passes checked=True
        self.register_buffer(_part_name(len(self.kinds)), blocks)
        self.kinds.append(kind)
        self.out_features += blocks.shape[0]

    @classmethod
    def from_parts(
        cls, parts: list[tuple[BlockKind, torch.Tensor]], in_features: int, bias: torch.Tensor | None = None
    ) -> QuantLinear:
        """A weight whose output rows are ``parts`` in order, each ``(kind, blocks)``."""
        if not parts:
            raise ValueError("a quantized projection needs at least one part")
        linear = cls(parts[0][0], parts[0][1], in_features, bias)
        for kind, blocks in parts[1:]:
            linear._add_part(kind, blocks)
        return linear

    @classmethod
    def from_linear(cls, linear: nn.Linear, parts: list[tuple[BlockKind, torch.Tensor]]) -> QuantLinear:
        """The quantized version of a dense projection, ``parts`` (``(kind, blocks)`` each)
        holding its weight; its bias is kept unless it was never loaded (still on the meta
        device)."""
        bias = None if linear.bias is None or linear.bias.is_meta else linear.bias
        return cls.from_parts(parts, linear.in_features, bias)

    @property
    def parts(self) -> list[tuple[BlockKind, torch.Tensor]]:
        """``(kind, blocks)`` of each part, in the order of their output rows."""
        return [(kind, getattr(self, _part_name(i))) for i, kind in enumerate(self.kinds)]

    @property
    def kind(self) -> BlockKind:
        """The kind of a one-part weight."""
        if len(self.kinds) != 1:
            raise AttributeError(f"a weight of {len(self.kinds)} parts has no one kind")
        return self.kinds[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # A decode batch takes the kernel for every part; a prefill chunk for each part the int8
        # kernel takes (interleaved), each other one decoded for torch's GEMM (a Q4_K_M q/k/v:
        # q, k Q4_K, v Q6_K).
        decode_batch = rows.shape[0] <= KERNEL_MAX_ROWS
        on_kernel = [
            self.use_kernel and (decode_batch or (self.int8_activations and kind.interleaved))
            for kind in self.kinds
        ]
        if not any(on_kernel):  # a prefill chunk: the blocks decoded once for torch's GEMM, reused
            out = F.linear(rows, self._decoded(x.dtype), self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        outs = [
            self._kernel(rows, kind, blocks)
            if kernel
            else F.linear(rows, _decode(kind, blocks, self.in_features, x.dtype, True, reuse=True))
            for (kind, blocks), kernel in zip(self.parts, on_kernel, strict=True)
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, rows: torch.Tensor, kind: BlockKind, blocks: torch.Tensor) -> torch.Tensor:
        """``rows @ W_part^T`` by the C kernel, in this module's activations."""
        return cpu_quant.quant_matmul(
            rows, kind, blocks, self.in_features, checked=True, int8_activations=self.int8_activations
        )

    def _decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in ``dtype`` (for a prefill chunk's GEMM), each part into its rows."""
        parts = self.parts
        if len(parts) == 1:
            kind, blocks = parts[0]
            return _decode(kind, blocks, self.in_features, dtype, self.use_kernel, reuse=True)
        if not self.use_kernel:
            return torch.cat([cpu_quant.dequantize_ref(k, b, self.in_features).to(dtype) for k, b in parts])
        weight = scratch(
            "dequantized_weight", (self.out_features, self.in_features), dtype, parts[0][1].device
        )
        first = 0
        for kind, blocks in parts:
            cpu_quant.quant_dequantize(
                kind, blocks, self.in_features, dtype, out=weight[first : first + blocks.shape[0]]
            )
            first += blocks.shape[0]
        return weight

    @property
    def int8_gemm(self) -> bool:
        """Prefill chunks too run the int8-activation kernel (interleaved weights: AVX512-VNNI)."""
        return self.int8_activations and all(kind.interleaved for kind in self.kinds)

    def use_int8_activations(self) -> None:
        """Quantize the activations to int8 in the decode kernel (``--quantization gguf-a8 /
        int8-a8``); before the first forward pass, which fixes each layer's fused call
        (``LlamaDecoderLayer.fused``)."""
        self.int8_activations = True

    def interleave(self, done: Interleaved) -> None:
        """Hold each part's blocks interleaved 16 rows at a time where its kind has such a layout
        for this module's activations (Q4_1, Q8_0; with int8 ones Q4_0, Q5_0, Q5_1, Q4_K too:
        ``BlockKind.interleaved_twin``), for the kernels that read them so
        (``cpu_quant.interleave_rows``); whole groups of 16 rows only, and blocks another module
        interleaved already (``done``) are taken from there, not made twice."""
        for i, (kind, blocks) in enumerate(self.parts):
            twin = kind.interleaved_twin(self.int8_activations)
            if twin is None or blocks.shape[0] % cpu_quant.X16_ROWS:
                continue
            pointer = blocks.data_ptr()
            if pointer not in done:
                done[pointer] = cpu_quant.interleave_rows(kind, blocks, self.in_features)
            self.kinds[i], interleaved = done[pointer]
            setattr(self, _part_name(i), interleaved)

    def describe(self) -> str:
        """What the weight is held as (``Q4_1``; ``Q4_K+Q6_K`` for parts), for ``weights.describe_weights``."""
        return "+".join(kind.name for kind in self.kinds)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this layer's weights (blocks and bias)."""
        held = [blocks for _, blocks in self.parts]
        return held if self.bias is None else [*held, self.bias]

    def extra_repr(self) -> str:
        activations = ", int8 activations" if self.int8_activations else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.describe()} blocks{activations}"
        )


def _part_name(index: int) -> str:
    """The buffer holding part ``index`` of a ``QuantLinear``'s weight."""
    return "blocks" if index == 0 else f"blocks_{index}"


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over a table held as GGUF blocks: looked-up rows are decoded."""

    blocks: torch.Tensor

    def __init__(self, kind: BlockKind, blocks: torch.Tensor, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.embedding_dim = embedding_dim
        self.num_embeddings = blocks.shape[0]
        self.dtype = dtype
        self.register_buffer("blocks", blocks.contiguous())
        self.use_kernel = cpu_quant.available()

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, kind: BlockKind, blocks: torch.Tensor, dtype: torch.dtype
    ) -> QuantEmbedding:
        """The quantized version of an embedding table, ``blocks`` holding it; looked-up rows
        are decoded to ``dtype``."""
        return cls(kind, blocks, embedding.embedding_dim, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = _decode(self.kind, self.blocks, self.embedding_dim, self.dtype, self.use_kernel, rows=ids)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The same blocks as an LM head (a tied model's logits read the table once more)."""
        return QuantLinear(self.kind, self.blocks, self.embedding_dim)

    def interleave(self, done: Interleaved) -> None:
        """Read the table interleaved where the LM head sharing it was (``done``, filled by the
        projections' ``QuantLinear.interleave``): lookups decode either layout, so a table of its
        own stays as it is."""
        if self.blocks.data_ptr() in done:
            self.kind, self.blocks = done[self.blocks.data_ptr()]

    def describe(self) -> str:
        """What the table is held as (``Q8_0``), for ``weights.describe_weights``."""
        return self.kind.name

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this layer's weights (the blocks)."""
        return [self.blocks]
