"""A decoder layer over GGUF-block weights as one C call for decode batches (``kernels/cpu/csrc/decoder_layer.c``).

At one sequence the per-op path (``llama.LlamaDecoderLayer``: each op already one C call) spent
a third of a SmolLM2-135M decode step in the Python around those calls. The model asks
``serves`` whether a layer's call can be the fused one instead: every token of the pass a decode
(one per sequence), a few of them, activations in fp32 or bf16 on the CPU, and the C attention
taking the cache; the model itself decides that the layer's four projections are blocks the C
kernel reads (``llama.LlamaDecoderLayer.fused``). Anything else (prefill chunks, dense weights,
a forced ``PDSERVE_KERNELS`` backend) keeps the per-op path, which computes the same values
(``decoder_layer.c`` says where they may differ).

The layer's constants (weights' pointers, shapes) are marshalled once into a ``PreparedLayer``
kept by the layer; a step marshals only its tensors. What a step's attention metadata must hold
is ``DecodeMetadata`` (the engine's ``AttentionMetadata`` has it): this module knows no engine
class.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels.cpu import layer_ops as cpu_layer_ops
from pdserve.kernels.cpu import paged_attention as cpu_attention
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.build import CLibrary
from pdserve.kernels.cpu.quant import BlockKind
from pdserve.kernels.reference import window_size


class DecodeMetadata(Protocol):
    """What the fused layer reads of a decode pass's attention metadata (the engine's
    ``AttentionMetadata`` satisfies it): how many of the pass's tokens are decodes, where each
    token's K/V goes, and each decoding sequence's blocks and length."""

    @property
    def num_decode_tokens(self) -> int: ...  # the first num_decode_tokens tokens are decodes

    @property
    def slot_mapping(self) -> torch.Tensor: ...  # [num_tokens] int64: each token's cache slot

    @property
    def decode_block_tables(self) -> torch.Tensor: ...  # [num_decodes, max_blocks] int32

    @property
    def decode_seq_lens(self) -> torch.Tensor: ...  # [num_decodes] int32, incl. the new token


WEIGHT_PARTS = 3  # decoder_layer.c's PD_WEIGHT_PARTS: row ranges of one projection (q, k, v)


class WeightArgs(ctypes.Structure):
    """``PdWeight`` of decoder_layer.c, field for field."""

    _fields_ = [
        ("blocks", ctypes.c_void_p * WEIGHT_PARTS),
        ("rows", ctypes.c_int64 * WEIGHT_PARTS),
        ("kinds", ctypes.c_int32 * WEIGHT_PARTS),
        ("parts", ctypes.c_int32),
    ]


class LayerArgs(ctypes.Structure):
    """``PdDecoderLayer`` of decoder_layer.c, field for field."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("sliding_window", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("qkv", WeightArgs),
        ("o", WeightArgs),
        ("gate_up", WeightArgs),
        ("down", WeightArgs),
        ("int8_activations", ctypes.c_int32),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("post_feedforward_norm", ctypes.c_void_p),
        ("norm_weight_f32", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("rope_table", ctypes.c_int32),
    ]


# decoder_layer.c's activations of the gated MLP
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_decoder_layers.argtypes = [
        ptr, i64, i64, cint, ptr, ptr, i64, ptr, ptr, ptr, cint, i64, i64, i64, ptr, ptr, i64, ptr, cint
    ]  # fmt: skip
    lib.pd_decoder_layers.restype = cint


KERNELS = CLibrary(
    ("decoder_layer", *cpu_quant.FAMILIES, "layer_ops", "paged_attention"), _declare, "fused decoder layer"
)


@dataclass(frozen=True)
class BlockWeight:
    """A projection's weight as the C kernel reads it: its output rows as one to
    ``WEIGHT_PARTS`` parts, each GGUF block rows of its own kind (``[rows, row bytes]`` uint8,
    contiguous), in order."""

    parts: tuple[tuple[BlockKind, torch.Tensor], ...]

    def args(self) -> WeightArgs:
        if not 1 <= len(self.parts) <= WEIGHT_PARTS:
            raise ValueError(f"a fused layer's weight has 1 to {WEIGHT_PARTS} parts, not {len(self.parts)}")
        args = WeightArgs(parts=len(self.parts))
        for i, (kind, blocks) in enumerate(self.parts):
            args.blocks[i], args.rows[i], args.kinds[i] = blocks.data_ptr(), blocks.shape[0], int(kind)
        return args


class PreparedLayer:
    """One layer's ``LayerArgs`` and the tensors its pointers point into (kept alive with it).

    ``sliding_window``: the layer's attention window ``W`` (``kernels.paged_attention_decode``'s:
    a token at ``p`` sees ``p - W < k <= p``), ``None`` or 0 for full attention. Per layer: the
    layers of one ``PreparedLayers`` run may differ in it (they share every other shape), and in
    ``rope_table`` (which of the pass's RoPE tables the layer rotates by: Gemma 3's local and
    global bases).

    Other families' parts: ``q_norm`` / ``k_norm`` (``[head_dim]``, qk-norm before RoPE: Qwen3,
    Gemma 3), ``post_attention_norm`` / ``post_feedforward_norm`` (``[hidden]``, a branch's norm
    before it joins the residual: Gemma 3), ``activation`` (``"silu"`` or ``"gelu_tanh"``) and
    ``scale`` (the attention's, ``head_dim ** -0.5`` unless given). Norm weights are in the
    activations' dtype (Llama's form), or all float32 (Gemma's ``1 + w``: the product rounded once).
    """

    def __init__(
        self,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        qkv: BlockWeight,
        o: BlockWeight,
        gate_up: BlockWeight,
        down: BlockWeight,
        qkv_bias: torch.Tensor | None = None,
        int8_activations: bool = False,
        sliding_window: int | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        post_attention_norm: torch.Tensor | None = None,
        post_feedforward_norm: torch.Tensor | None = None,
        activation: str = "silu",
        scale: float | None = None,
        rope_table: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        if (q_norm is None) != (k_norm is None):
            raise ValueError("qk-norm needs both q_norm and k_norm")
        if (post_attention_norm is None) != (post_feedforward_norm is None):
            raise ValueError("post-norms come as a pair: post_attention_norm and post_feedforward_norm")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: one of {sorted(ACTIVATIONS)}")
        given = (input_norm, post_norm, q_norm, k_norm, post_attention_norm, post_feedforward_norm)
        norms = tuple(None if n is None else n.detach().contiguous() for n in given)
        bias = None if qkv_bias is None else qkv_bias.detach().contiguous()
        self.dtype = dtype or input_norm.dtype  # the activations'
        norm_dtypes = {n.dtype for n in norms if n is not None}
        weight_f32 = norm_dtypes == {torch.float32} and self.dtype != torch.float32
        if not (norm_dtypes == {self.dtype} or weight_f32) or (bias is not None and bias.dtype != self.dtype):
            raise ValueError(
                "the fused layer's norms (or all float32) and bias must share the activations' dtype"
            )
        weights = (qkv, o, gate_up, down)
        held = [blocks for weight in weights for _, blocks in weight.parts]
        if any(blocks.dtype != torch.uint8 or not blocks.is_contiguous() for blocks in held):
            raise ValueError("the fused layer's weights must be contiguous uint8 block rows")
        self._alive = [*(n for n in norms if n is not None), *held, *([] if bias is None else [bias])]
        pointer = [None if n is None else n.data_ptr() for n in norms]
        self.args = LayerArgs(
            hidden=input_norm.numel(),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            sliding_window=window_size(sliding_window),
            eps=eps,
            scale=head_dim**-0.5 if scale is None else scale,
            input_norm=pointer[0],
            post_norm=pointer[1],
            qkv_bias=None if bias is None else bias.data_ptr(),
            qkv=qkv.args(),
            o=o.args(),
            gate_up=gate_up.args(),
            down=down.args(),
            int8_activations=int(int8_activations),
            q_norm=pointer[2],
            k_norm=pointer[3],
            post_attention_norm=pointer[4],
            post_feedforward_norm=pointer[5],
            norm_weight_f32=int(weight_f32),
            activation=ACTIVATIONS[activation],
            rope_table=rope_table,
        )


def available() -> bool:
    """True when the fused layer's library builds and loads here (logged once, why it does not)."""
    return KERNELS.available()


def serves(
    prepared: PreparedLayer,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: DecodeMetadata,
    max_rows: int,
) -> bool:
    """True when ``decoder_layer`` runs this call: every token a decode, 1 to ``max_rows`` of
    them, activations (and RoPE tables) in the layer's dtype, and the C ops taking the tensors
    (``cpu_layer_ops.serves`` also says no to a forced ``PDSERVE_KERNELS`` backend; that the
    library loads was asked when the layer was prepared, ``LlamaDecoderLayer.fused``)."""
    rows = hidden.shape[0]
    args = prepared.args
    return (
        0 < rows <= max_rows
        and meta.num_decode_tokens == rows
        and cos.dtype == hidden.dtype == prepared.dtype
        and cpu_layer_ops.serves(hidden)
        and cpu_attention.serves_heads(args.heads, args.head_dim, kv_cache_layer)
    )


class PreparedLayers:
    """Consecutive layers' ``LayerArgs`` as one C array (``pd_decoder_layers`` runs any run of
    them in one call), built once per model; every layer shares the first one's shapes (not its
    sliding window: each layer attends through its own)."""

    def __init__(self, layers: Sequence[PreparedLayer]) -> None:
        if not layers:
            raise ValueError("no layers to prepare")
        self.layers = tuple(layers)
        self.first = self.layers[0]
        shape = _shape(self.first.args)
        if any(_shape(layer.args) != shape or layer.dtype != self.first.dtype for layer in self.layers):
            raise ValueError("fused layers must share their shapes and dtype")
        self.array = (LayerArgs * len(self.layers))(*(layer.args for layer in self.layers))

    def __len__(self) -> int:
        return len(self.layers)


def _shape(args: LayerArgs) -> tuple[int | float, ...]:
    return (args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, args.eps, args.scale)


def _tables_first(table: torch.Tensor) -> torch.Tensor:
    """A pass's RoPE table ``[rows, tables, head_dim]`` as decoder_layer.c reads it: ``[tables,
    rows, head_dim]``, contiguous (each layer's table one block)."""
    return table.transpose(0, 1).contiguous()


class FusedPass:
    """A decode pass's tensors as the C side reads them, marshalled once for the pass: each run
    of layers in it (between two of the engine's input polls, or all of them) is then one C call
    with no per-layer Python (``serves`` said yes for the pass first)."""

    def __init__(
        self,
        layers: PreparedLayers,
        cos: torch.Tensor,  # [rows, tables, head_dim], the activations' dtype
        sin_signed: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        meta: DecodeMetadata,
    ) -> None:
        self.layers = layers
        self.cos, self.sin_signed = _tables_first(cos), _tables_first(sin_signed)
        self.kv_cache = kv_cache
        self.slots = meta.slot_mapping.to(torch.int64).contiguous()
        self.tables = meta.decode_block_tables.to(torch.int32).contiguous()
        self.lens = meta.decode_seq_lens.to(torch.int32).contiguous()

    def run(self, first: int, last: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layers ``first .. last - 1`` over ``hidden`` ``[rows, hidden]`` (not changed): their output."""
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"layers {first}..{last} of {len(self.layers)}")
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        cache = self.kv_cache
        status = KERNELS.load().pd_decoder_layers(
            ctypes.byref(self.layers.array, first * ctypes.sizeof(LayerArgs)),
            last - first,
            cache.stride(1),
            int(hidden.dtype == torch.bfloat16),
            hidden.data_ptr(),
            out.data_ptr(),
            hidden.shape[0],
            self.cos.data_ptr(),
            self.sin_signed.data_ptr(),
            cache.data_ptr() + first * cache.stride(1) * cache.element_size(),
            int(cache.dtype == torch.bfloat16),
            cache.shape[3],
            cache.stride(0),
            cache.stride(2),
            self.slots.data_ptr(),
            self.tables.data_ptr(),
            self.tables.shape[1],
            self.lens.data_ptr(),
            torch.get_num_threads(),  # read per call: lent cores come and go between layers
        )
        if status != 0:
            raise MemoryError("fused decoder layers: their buffers could not be allocated")
        return out


def decoder_layer(
    prepared: PreparedLayer,
    hidden: torch.Tensor,  # [rows, hidden]: one decode token per sequence
    cos: torch.Tensor,  # [rows, tables, head_dim], hidden's dtype
    sin_signed: torch.Tensor,
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, kv_heads, head_dim]
    meta: DecodeMetadata,
) -> torch.Tensor:  # [rows, hidden]: the layer's output (hidden itself is not changed)
    """The layer over ``hidden`` as one C call; the step's K and V go into the cache as the
    per-op path writes them. (A pass over many layers: ``FusedPass``.)"""
    one_layer_cache = kv_cache_layer.unsqueeze(1)  # [num_blocks, 1, 2, ...]: the engine cache's shape
    return FusedPass(PreparedLayers([prepared]), cos, sin_signed, one_layer_cache, meta).run(0, 1, hidden)
