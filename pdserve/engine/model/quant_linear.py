"""Weight-only quantized projections, embedding and LM head (``--quantization gguf | int8``).

A decode step at small batch reads every weight once, so its time is the weights' bytes over
the memory bandwidth. Kept as GGUF blocks, SmolLM2-135M's layers stream 5 bits a weight (Q4_1)
instead of bf16's 16. The modules here hold the blocks (``pdserve.kernels.cpu.quant``) and
leave activations in the model's dtype:

* up to ``KERNEL_MAX_ROWS`` rows (decode batches) the C kernel decodes blocks in registers;
* more rows (prefill chunks) are compute-bound, so the blocks are decoded once to the
  activations' dtype and multiplied by torch's GEMM, whose arithmetic outruns the kernel's.

``--quantization gguf-a8 / int8-a8`` (``use_int8_activations``) opts in to one more rounding:
the kernel's x quantized to int8 per block of 32, as llama.cpp does, whose integer dots need a
fraction of the fp32 arithmetic (``kernels/cpu/csrc/int8_activations.c``). Where the CPU has
AVX512-VNNI the weights are interleaved (``kernels/cpu/csrc/int8_x16.c``) and prefill chunks run that
kernel too, as llama.cpp's prompt processing does: one vpdpbusd is 64 multiply-adds where
vdpbf16ps is 32, so SmolLM2-135M's layers took 90 ms of a 256-token prompt instead of 125
(decode + bf16 GEMM, one Zen 5 core). Elsewhere prefill chunks decode the blocks as above. What
it costs in quality is measured in tests/engine/model/test_quality_quant.py.

The tied embedding and LM head share one block tensor, counted once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.gguf_blocks import quantize_q8_0
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BLOCK_SIZE, BlockKind
from pdserve.kernels.scratch import scratch

if TYPE_CHECKING:
    from pdserve.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

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
    """``nn.Linear``'s forward over a weight held as GGUF blocks (buffer ``blocks``)."""

    blocks: torch.Tensor

    def __init__(
        self, kind: BlockKind, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if blocks.shape[1] != in_features // BLOCK_SIZE * kind.block_bytes:
            raise ValueError(f"{kind.name} blocks {tuple(blocks.shape)} do not hold rows of {in_features}")
        blocks = blocks.contiguous()
        cpu_quant.check_blocks(kind, blocks, in_features)  # once: forward passes checked=True
        self.kind = kind
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = cpu_quant.available()
        self.int8_activations = False  # use_int8_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.use_kernel and (rows.shape[0] <= KERNEL_MAX_ROWS or self.int8_gemm):
            out = cpu_quant.quant_matmul(
                rows,
                self.kind,
                self.blocks,
                self.in_features,
                checked=True,
                int8_activations=self.int8_activations,
            )
            if self.bias is not None:
                out = out + self.bias
        else:  # a prefill chunk: the blocks decoded once for torch's GEMM, into a reused buffer
            weight = _decode(self.kind, self.blocks, self.in_features, x.dtype, self.use_kernel, reuse=True)
            out = F.linear(rows, weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def int8_gemm(self) -> bool:
        """Prefill chunks too run the int8-activation kernel (interleaved weights: AVX512-VNNI)."""
        return self.int8_activations and self.kind.interleaved

    def extra_repr(self) -> str:
        activations = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.name} blocks{activations}"


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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = _decode(self.kind, self.blocks, self.embedding_dim, self.dtype, self.use_kernel, rows=ids)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The same blocks as an LM head (a tied model's logits read the table once more)."""
        return QuantLinear(self.kind, self.blocks, self.embedding_dim)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def install_blocks(
    model: LlamaForCausalLM, blocks: dict[str, tuple[BlockKind, torch.Tensor]], dtype: torch.dtype
) -> None:
    """Replace the modules whose ``.weight`` is in ``blocks`` (model parameter names) by their
    quantized versions; the LM head of a tied model reads the embedding's blocks."""
    for name, (kind, tensor) in blocks.items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        if isinstance(module, nn.Embedding):
            _set_submodule(model, module_name, QuantEmbedding(kind, tensor, module.embedding_dim, dtype))
        elif isinstance(module, nn.Linear):
            bias = None if module.bias is None or module.bias.is_meta else module.bias
            _set_submodule(model, module_name, QuantLinear(kind, tensor, module.in_features, bias))
        else:
            raise TypeError(f"{name}: no quantized version of {type(module).__name__}")
    embed = model.model.embed_tokens
    if model.lm_head is not None and isinstance(model.lm_head, QuantLinear):
        model.quant_lm_head = model.lm_head
    elif model.lm_head is None and isinstance(embed, QuantEmbedding):
        model.quant_lm_head = embed.as_linear()
    if dtype == torch.bfloat16 and cpu_quant.bf16_x16_route():
        # bf16 decode matmuls and LM head over blocks interleaved by 16 rows (kernels/cpu/csrc/bf16_x16.c)
        _interleave(model, [m for m in model.modules() if isinstance(m, QuantLinear)])


def quantize_int8(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[BlockKind, torch.Tensor]]]:
    """``(dense, blocks)``: Q8_0 blocks (symmetric int8, one fp16 scale per 32 weights) of every
    matrix of a model state dict (the projections, the embedding, an untied LM head: norms
    and biases are vectors), the rest as it is; for ``build_model(..., blocks=)``."""
    blocks = {
        name: (BlockKind.Q8_0, quantize_q8_0(tensor))
        for name, tensor in state_dict.items()
        if tensor.dim() == 2 and tensor.shape[1] % BLOCK_SIZE == 0
    }
    return {name: t for name, t in state_dict.items() if name not in blocks}, blocks


def use_int8_activations(model: nn.Module) -> None:
    """Make every block-held projection and LM head of ``model`` quantize its activations to
    int8 in the decode kernel (``--quantization gguf-a8 / int8-a8``); before the first forward
    pass, which fixes each layer's fused call (``LlamaDecoderLayer.fused``)."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not linears:
        raise ValueError("int8 activations need block-held weights (--quantization gguf-a8 or int8-a8)")
    for linear in linears:
        linear.int8_activations = True
    if cpu_quant.x16_route():
        _interleave(model, linears)


def _interleave(model: nn.Module, linears: list[QuantLinear]) -> None:
    """Hold these projections' blocks interleaved 16 rows at a time (whole groups of 16 only), for
    the kernels that read them so: int8 activations on AVX512-VNNI (at 8 rows of x SmolLM2-135M's
    layer matrices took 9.4 ms a step row-major, 3.5 interleaved; at one row, 2.2 and 1.9, one Zen
    5 core), and bf16 ones on AVX512-BF16 (``install_blocks``; the Q8_0 LM head at one row: 1.1 ms
    row-major, 0.78 interleaved). Prefill chunks and the
    embedding lookup decode either layout. A table shared by the tied embedding and LM head is
    interleaved once and stays shared (the weights' bytes do not change)."""
    done: dict[int, tuple[BlockKind, torch.Tensor]] = {}  # by the plain blocks' data pointer
    for linear in linears:
        if linear.kind.interleaved or linear.out_features % cpu_quant.X16_ROWS:
            continue
        pointer = linear.blocks.data_ptr()
        if pointer not in done:
            done[pointer] = cpu_quant.interleave_rows(linear.kind, linear.blocks, linear.in_features)
        linear.kind, linear.blocks = done[pointer]
    for embedding in model.modules():
        if isinstance(embedding, QuantEmbedding) and embedding.blocks.data_ptr() in done:
            embedding.kind, embedding.blocks = done[embedding.blocks.data_ptr()]


def describe_weights(model: nn.Module) -> str:
    """What the weights are held as, for logs and handshakes: e.g. ``Q4_1 x210, Q8_0 x1, bfloat16``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            counts[module.kind.name] = counts.get(module.kind.name, 0) + 1
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    parts = [f"{kind} x{count}" for kind, count in sorted(counts.items())]
    if any(isinstance(m, QuantLinear) and m.int8_activations for m in model.modules()):
        parts.append("int8 activations")
    return ", ".join([*parts, str(dtype).removeprefix("torch.")])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (parameters, blocks and packed copies), each storage
    counted once: the tied table and LM head share theirs."""
    seen: set[int] = set()
    total = 0
    tensors = [
        *model.parameters(),
        *(m.blocks for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))),
    ]
    packed: list[torch.Tensor | None] = [getattr(m, "packed_weight", None) for m in model.modules()]
    packed.append(getattr(model, "packed_lm_head", None))
    for tensor in tensors:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            total += tensor.untyped_storage().nbytes()
    for packed_weight in packed:
        if packed_weight is not None:
            total += packed_weight.numel() * packed_weight.element_size()
    return total
