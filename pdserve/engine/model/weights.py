"""A model's weights from a state dict to serving: the walks over a whole model.

Building a model (``build_model``), converting state dicts between HF's names and ours
(``hf_to_model_state_dict``), and what a load does next: GGUF blocks in place of dense modules
(``install_blocks``), int8 activations (``use_int8_activations``), the dense projections laid out
``[in, out]`` (``use_kn_weight_layout``) or packed for oneDNN (``pack_linear_weights``); then what
the weights are (``describe_weights``) and their bytes (``weight_bytes``).

As in vLLM's loader, whose walk calls each layer's quantization method
(``process_weights_after_loading``), the walks here only visit modules: what a layer does with its
own weights is the layer's method (``QuantLinear.from_linear``, ``QuantLinear.interleave``,
``PackedLinear.from_linear``, ``describe``, ``weight_tensors``). The model families' code never
branches on how their weights are held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gemma3 import Gemma3ForCausalLM
from pdserve.engine.model.gguf_blocks import quantize_q8_0
from pdserve.engine.model.layers.linear import PackedLinear, can_pack, pack_weight
from pdserve.engine.model.layers.quant_linear import Interleaved, QuantEmbedding, QuantLinear
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.qwen3 import Qwen3ForCausalLM
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BLOCK_SIZE, BlockKind

if TYPE_CHECKING:
    from collections.abc import Iterator

logger = logging.getLogger(__name__)

# ``ModelArchConfig.family`` -> the class that builds it (arch.MODEL_TYPE_FAMILIES and the GGUF
# loader's architectures map to these names).
MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}

# Weights held as GGUF blocks, by model parameter name: ``(kind, blocks)``, or a fused projection's
# parts of different kinds (``[(kind, blocks), ...]`` in the order of their rows).
BlockPart = tuple[BlockKind, torch.Tensor]
BlockState = dict[str, BlockPart | list[BlockPart]]

# HF parameter suffixes fused into one of ours: {fused suffix: HF suffixes in concatenation order}
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def hf_to_model_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """HF parameter names -> this module's (q/k/v and gate/up concatenated), for every family:
    their other names (norms, qk-norms) are HF's.

    Drops what this model has no parameter for: ``lm_head.weight`` of tied checkpoints (some
    store a copy) and old ``rotary_emb.inv_freq`` buffers.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if "rotary_emb.inv_freq" in name or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        out[name] = tensor
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                present = [n in out for n in names]
                if not any(present):
                    continue
                if not all(present):
                    raise KeyError(f"checkpoint has only some of {names}")
                out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def model_to_hf_state_dict(
    state: dict[str, torch.Tensor], config: ModelArchConfig
) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_to_model_state_dict`` (split views, no copies)."""
    sizes = {
        "self_attn.qkv_proj": [
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        ],
        "mlp.gate_up_proj": [config.intermediate_size, config.intermediate_size],
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for fused, parts in FUSED_PROJECTIONS.items():
            if f".{fused}." in name:
                prefix, kind = name.split(f"{fused}.")
                for part, piece in zip(parts, torch.split(tensor, sizes[fused], dim=0), strict=True):
                    out[f"{prefix}{part}.{kind}"] = piece
                break
        else:
            out[name] = tensor
    return out


def build_model(
    config: ModelArchConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    blocks: BlockState | None = None,
) -> LlamaForCausalLM:
    """A ready-to-serve model from its state dict: eval mode, no grads, weights not copied.

    Built on the meta device and filled with ``assign=True``: random-initialising 135M
    parameters only to overwrite them costs about a second. ``blocks`` (``--quantization``)
    holds the weights kept as GGUF blocks, by parameter name: their modules are replaced by the
    quantized versions (``install_blocks``) and never get dense memory; the state dict then
    holds the rest (norms, biases, types without a kernel).
    """
    if config.family not in MODEL_FAMILIES:
        raise ValueError(f"model family {config.family!r} not in {sorted(MODEL_FAMILIES)}")
    with torch.device("meta"):
        model = MODEL_FAMILIES[config.family](config)
    model.load_state_dict(state_dict, strict=not blocks, assign=True)
    if blocks:
        assert dtype is not None, "a block-held embedding decodes to the model's dtype"
        install_blocks(model, blocks, dtype)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        still_meta = [name for name, tensor in tensors if tensor.is_meta]
        if still_meta:
            raise KeyError(f"weights missing from the checkpoint: {still_meta[:5]}")
    if dtype is not None:
        model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    use_kn_weight_layout(model)
    return model


def _layer_linears(model: LlamaForCausalLM) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, projection)`` for every dense projection of the decoder layers (the
    children of a layer's attention and MLP), the block-held ones left out."""
    for layer in model.model.layers:
        for parent in layer.children():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    yield parent, name, child


def use_kn_weight_layout(model: LlamaForCausalLM) -> None:
    """Store each decoder-layer projection as ``[in, out]`` in memory, seen as ``[out, in]``.

    Same values, same shapes, same state-dict names; only the strides change. With ``x @ W``
    instead of ``x @ W.T``, MKL's sgemm runs skinny batches (decode: 8-64 rows) 1.2-2x faster
    when it is compute-bound (measured on SmolLM2's shapes, weights in cache) and large prefill
    batches at the same speed; when a step is bound by streaming the weights from memory both
    layouts run alike. The LM head keeps its layout: it is the embedding table when tied, and at
    49k rows it is memory-bound anyway. Projections held as blocks have no dense weight to lay out.
    """
    for _, _, linear in _layer_linears(model):
        linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t(), requires_grad=False)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def install_blocks(model: LlamaForCausalLM, blocks: BlockState, dtype: torch.dtype) -> None:
    """Replace the modules whose ``.weight`` is in ``blocks`` (model parameter names) by their
    quantized versions; the LM head of a tied model reads the embedding's blocks."""
    for name, held in blocks.items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        parts = held if isinstance(held, list) else [held]
        if isinstance(module, nn.Embedding) and len(parts) == 1:
            kind, tensor = parts[0]
            _set_submodule(model, module_name, QuantEmbedding.from_embedding(module, kind, tensor, dtype))
        elif isinstance(module, nn.Linear):
            _set_submodule(model, module_name, QuantLinear.from_linear(module, parts))
        else:
            raise TypeError(f"{name}: no quantized version of {type(module).__name__}")
    embed = model.model.embed_tokens
    if model.lm_head is not None and isinstance(model.lm_head, QuantLinear):
        model.quant_lm_head = model.lm_head
    elif model.lm_head is None and isinstance(embed, QuantEmbedding):
        model.quant_lm_head = embed.as_linear()
    if dtype == torch.bfloat16 and cpu_quant.bf16_x16_route():
        # bf16 decode matmuls and LM head over blocks interleaved by 16 rows (kernels/cpu/csrc/repack_bf16.c)
        _interleave(model, [m for m in model.modules() if isinstance(m, QuantLinear)])


def quantize_int8(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], BlockState]:
    """``(dense, blocks)``: Q8_0 blocks (symmetric int8, one fp16 scale per 32 weights) of every
    matrix of a model state dict (the projections, the embedding, an untied LM head: norms
    and biases are vectors), the rest as it is; for ``build_model(..., blocks=)``."""
    blocks: BlockState = {
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
        linear.use_int8_activations()
    if cpu_quant.x16_route():
        _interleave(model, linears)


def _interleave(model: nn.Module, linears: list[QuantLinear]) -> None:
    """Hold these projections' blocks interleaved 16 rows at a time (``QuantLinear.interleave``),
    for the kernels that read them so: int8 activations on AVX512-VNNI (at 8 rows of x
    SmolLM2-135M's layer matrices took 9.4 ms a step row-major, 3.5 interleaved; at one row, 2.2
    and 1.9, one Zen 5 core), and bf16 ones on AVX512-BF16 (``install_blocks``; the Q8_0 LM head
    at one row: 1.1 ms row-major, 0.78 interleaved). Prefill chunks and the embedding lookup
    decode either layout. A table shared by the tied embedding and LM head is interleaved once
    and stays shared (the weights' bytes do not change)."""
    done: Interleaved = {}
    for linear in linears:
        linear.interleave(done)
    for embedding in model.modules():
        if isinstance(embedding, QuantEmbedding):
            embedding.interleave(done)


def pack_linear_weights(model: LlamaForCausalLM) -> int:
    """Replace every ``nn.Linear`` under ``model.model.layers`` by a ``PackedLinear``, and give
    the model a packed copy of its LM head (``packed_lm_head``) when ``can_pack`` allows;
    returns how many projections were packed (0: the model is left as it was).

    The tied embedding table stays as it is for the lookup; the LM head's packed copy costs its
    bytes once more (56 MB in bf16 for SmolLM2) and saves ~40% of the logits matmul.
    """
    dtype = model.dtype
    if not can_pack(dtype):
        return 0
    count = 0
    for parent, name, linear in list(_layer_linears(model)):
        setattr(parent, name, PackedLinear.from_linear(linear))
        count += 1
    if model.quant_lm_head is None:  # a head held as blocks (--quantization) has its own kernel
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        model.packed_lm_head = pack_weight(head.weight)
    logger.info(
        "%d projections packed for oneDNN (%s), LM head %s",
        count,
        dtype,
        "as blocks" if model.quant_lm_head is not None else "packed",
    )
    return count


def describe_weights(model: nn.Module) -> str:
    """What the weights are held as, for logs and handshakes: e.g. ``Q4_1 x210, Q8_0 x1, bfloat16``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            counts[module.describe()] = counts.get(module.describe(), 0) + 1
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    parts = [f"{kind} x{count}" for kind, count in sorted(counts.items())]
    if any(isinstance(m, QuantLinear) and m.int8_activations for m in model.modules()):
        parts.append("int8 activations")
    return ", ".join([*parts, str(dtype).removeprefix("torch.")])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (parameters, and the tensors its layers hold their
    weights in: blocks and packed copies), each storage counted once: the tied table and LM head
    share theirs. A packed (oneDNN, opaque) tensor has no storage to share: its elements count."""
    tensors: list[torch.Tensor] = [*model.parameters()]
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding, PackedLinear)):
            tensors.extend(module.weight_tensors())
    packed_lm_head = getattr(model, "packed_lm_head", None)
    if packed_lm_head is not None:
        tensors.append(packed_lm_head)
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.is_mkldnn:
            total += tensor.numel() * tensor.element_size()
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            total += tensor.untyped_storage().nbytes()
    return total
