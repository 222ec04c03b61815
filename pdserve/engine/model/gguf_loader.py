"""Read a llama.cpp GGUF file into a ``ModelArchConfig`` and a dense state dict.

Weights are dequantised with the ``gguf`` package (the same routine transformers uses), so a
Q4_1 file gives exactly the float32 values transformers loads from it. Two things llama.cpp's
converter does must be undone:

* GGUF lists tensor dims innermost-first (``[in, out]``); ``GGUFFile`` already hands out
  numpy-ordered arrays (``[out, in]``), and ``dequantize`` keeps that order, so no transpose.
* For ``llama`` files, ``convert_hf_to_gguf.py`` permutes the rows of q/k projections from HF's
  "rotate_half" RoPE layout to GGML's interleaved one; ``unpermute_qk`` reverses that (Qwen2
  files are not permuted).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import torch

from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_blocks import KERNEL_KIND, permute_block_rows, to_kernel_blocks
from pdserve.engine.model.gguf_file import GGUFFile, GGUFTensor
from pdserve.engine.model.weights import FUSED_PROJECTIONS, hf_to_model_state_dict
from pdserve.kernels.cpu.quant import BLOCK_SIZE, BlockKind, dequantize_ref

logger = logging.getLogger(__name__)

# Architectures this loader reads, and whether llama.cpp permuted their q/k rows.
_PERMUTED_QK = {"llama": True, "qwen2": False}

# GGUF leaf name -> HF parameter name (``{i}`` is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str) -> GGUFFile:
    """Parse a GGUF header (share it between the weights' and the tokenizer's loaders)."""
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default=None):
    """A metadata value as a Python object (str, int, float, list), or ``default``."""
    return reader.field(key, default)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(w, n_head, n_head_kv)`` on q/k rows (weights or biases).

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``; this is its
    inverse, and the same as transformers' ``reverse_permute_weights`` (k uses the KV head count).
    """
    rest = weight.shape[1:]
    half_dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half_dim, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def read_arch_config(reader: GGUFFile) -> ModelArchConfig:
    """Architecture numbers from ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    arch = field(reader, "general.architecture")
    if arch not in _PERMUTED_QK:
        raise ValueError(f"GGUF architecture {arch!r} not supported (expected one of {sorted(_PERMUTED_QK)})")
    num_heads = field(reader, f"{arch}.attention.head_count")
    hidden = field(reader, f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"])
    return ModelArchConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_layers=field(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=field(reader, f"{arch}.attention.key_length")
        or field(reader, f"{arch}.rope.dimension_count")
        or hidden // num_heads,
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=field(reader, f"{arch}.context_length", 4096),
        # llama.cpp drops output.weight when it is the embedding (as transformers concludes too).
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        rope_scaling=_rope_scaling(reader, arch),
    )


def _rope_scaling(reader: GGUFFile, arch: str) -> dict | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    tensor = reader.tensor("rope_freqs.weight")
    if tensor is not None:
        # Llama 3.1+ files bake the llama3 scaling into per-frequency divisors.
        factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    raise NotImplementedError(f"GGUF rope scaling type {kind!r}")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{leaf}.{weight|bias}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _gguf_tensors(reader: GGUFFile) -> list[tuple[GGUFTensor, str]]:
    """``(tensor, HF name)`` for every tensor the model has a parameter for."""
    wanted = [(t, name) for t in reader.tensors if (name := _hf_name(t.name)) is not None]
    skipped = sorted(t.name for t in reader.tensors if _hf_name(t.name) is None)
    if skipped:
        logger.debug("GGUF tensors without a model parameter (ignored): %s", skipped)
    return wanted


def _qk_heads(name: str, config: ModelArchConfig) -> int | None:
    """The head count llama.cpp permuted ``name``'s rows with (None: not permuted)."""
    if ".q_proj." in name:
        return config.num_heads
    if ".k_proj." in name:
        return config.num_kv_heads
    return None


def load_gguf_hf_state_dict(
    path: str, dtype: str | torch.dtype = "float32", reader: GGUFFile | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """Dequantised weights under HF Llama names (unfused), q/k un-permuted."""
    reader = reader if reader is not None else open_gguf(path)
    torch_dtype = parse_dtype(dtype)
    config = read_arch_config(reader)
    permuted = _PERMUTED_QK[field(reader, "general.architecture")]

    def convert(item: tuple[GGUFTensor, str]) -> tuple[str, torch.Tensor]:
        tensor, name = item
        return name, _dequantized(tensor, name, config, permuted).to(torch_dtype)

    # numpy releases the GIL in the dequantisation kernels, so two threads nearly halve the time.
    with ThreadPoolExecutor(max_workers=max(1, min(4, torch.get_num_threads()))) as pool:
        state = dict(pool.map(convert, _gguf_tensors(reader)))
    return config, state


def _fused_names(config: ModelArchConfig) -> list[tuple[str, tuple[str, ...]]]:
    """``(fused weight name, its HF parts)`` for every layer (q/k/v and gate/up)."""
    return [
        (f"model.layers.{i}.{fused}.weight", tuple(f"model.layers.{i}.{part}.weight" for part in parts))
        for i in range(config.num_layers)
        for fused, parts in FUSED_PROJECTIONS.items()
    ]


def _densify_mixed_groups(
    hf_blocks: dict[str, torch.Tensor],
    kinds: dict[str, BlockKind],
    hf_dense: dict[str, torch.Tensor],
    config: ModelArchConfig,
) -> None:
    """Move to ``hf_dense`` (decoded) every part of a fused group whose parts are not all blocks
    of one kind, so each group is fused from one side only."""
    for _, parts in _fused_names(config):
        held = [part for part in parts if part in hf_blocks]
        if held and (len(held) < len(parts) or len({kinds[part] for part in held}) > 1):
            for part in held:
                blocks, kind = hf_blocks.pop(part), kinds.pop(part)
                in_features = blocks.shape[1] // kind.block_bytes * BLOCK_SIZE
                hf_dense[part] = dequantize_ref(kind, blocks, in_features)
            logger.info("%s: parts of different types, served dense", ", ".join(parts))


def _dequantized(tensor: GGUFTensor, name: str, config: ModelArchConfig, permuted: bool) -> torch.Tensor:
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    heads = _qk_heads(name, config) if permuted else None
    if heads is not None:
        weight = unpermute_qk(weight, heads)
    # np.array copies out of the read-only memmap; torch then owns the memory.
    return torch.from_numpy(np.array(weight, dtype=np.float32))


def load_gguf_blocks(
    path: str, dtype: str | torch.dtype = "float32", reader: GGUFFile | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor], dict[str, tuple[BlockKind, torch.Tensor]]]:
    """The file's weights as they are, for ``--quantization gguf``: ``(config, dense, blocks)``.

    ``blocks`` maps this model's parameter names (fused q/k/v and gate/up) to kernel blocks
    (see ``gguf_blocks``); ``dense`` holds the rest (norms, and any tensor of a type without a
    kernel) dequantised to ``dtype``. A fused projection whose parts differ in type (a Q4_K q
    with a Q6_K v, as llama.cpp's mixed "_M" files have) is dense as a whole.
    """
    reader = reader if reader is not None else open_gguf(path)
    torch_dtype = parse_dtype(dtype)
    config = read_arch_config(reader)
    permuted = _PERMUTED_QK[field(reader, "general.architecture")]
    hf_dense: dict[str, torch.Tensor] = {}
    hf_blocks: dict[str, torch.Tensor] = {}
    kinds: dict[str, BlockKind] = {}
    for tensor, name in _gguf_tensors(reader):
        rows, in_features = (int(n) for n in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        if tensor.tensor_type not in KERNEL_KIND or not name.endswith(".weight") or rows == 0:
            hf_dense[name] = _dequantized(tensor, name, config, permuted)
            continue
        kind, blocks = to_kernel_blocks(tensor.tensor_type, tensor.data, rows, in_features)
        heads = _qk_heads(name, config) if permuted else None
        if heads is not None:
            blocks = permute_block_rows(blocks, unpermute_qk(np.arange(rows), heads))
        hf_blocks[name], kinds[name] = blocks, kind
    _densify_mixed_groups(hf_blocks, kinds, hf_dense, config)
    fused_kinds = {name: kinds[parts[0]] for name, parts in _fused_names(config) if parts[0] in hf_blocks}
    block_state = {
        name: (fused_kinds[name] if name in fused_kinds else kinds[name], blocks)
        for name, blocks in hf_to_model_state_dict(hf_blocks, config).items()
    }
    dense = hf_to_model_state_dict(hf_dense, config)
    return config, {name: t.to(torch_dtype) for name, t in dense.items()}, block_state


def load_gguf(
    path: str, dtype: str | torch.dtype = "float32", reader: GGUFFile | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` ready for ``LlamaForCausalLM.load_state_dict``."""
    config, hf_state = load_gguf_hf_state_dict(path, dtype, reader)
    return config, hf_to_model_state_dict(hf_state, config)
