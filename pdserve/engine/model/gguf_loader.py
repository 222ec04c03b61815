"""Read a llama.cpp GGUF file into a ``ModelArchConfig`` and a dense state dict.

Weights are dequantised with the ``gguf`` package (the same routine transformers uses), so a
Q4_1 file gives exactly the float32 values transformers loads from it. What llama.cpp's
converter does is undone:

* GGUF lists tensor dims innermost-first (``[in, out]``); ``GGUFFile`` already hands out
  numpy-ordered arrays (``[out, in]``), and ``dequantize`` keeps that order, so no transpose.
* For ``llama`` files, ``convert_hf_to_gguf.py`` permutes the rows of q/k projections from HF's
  "rotate_half" RoPE layout to GGML's interleaved one; ``unpermute_qk`` reverses that (Qwen2,
  Qwen3 and Gemma 3 files are not permuted).
* For ``gemma3`` files it stores every norm weight plus one (Gemma's norms scale by ``1 + w``);
  the loader subtracts it again, in float32 as transformers does.

What a file does not say is llama.cpp's: a ``gemma3`` file's sliding layers are five of every six
with a local RoPE base of 10000 unless ``sliding_window_pattern`` / ``rope.freq_base_swa`` say
otherwise, and ``llama`` / ``qwen2`` / ``qwen3`` files attend to every key (llama.cpp reads no
sliding window for them: a Mistral converted to arch ``llama`` loses its window, in llama.cpp as
here).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import gguf
import numpy as np
import torch

from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.arch import ModelArchConfig, UnsupportedModelError
from pdserve.engine.model.gguf_blocks import KERNEL_KIND, permute_block_rows, to_kernel_blocks
from pdserve.engine.model.gguf_file import GGUFFile, GGUFTensor
from pdserve.engine.model.weights import FUSED_PROJECTIONS, BlockPart, BlockState, hf_to_model_state_dict
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind, dequantize_ref

logger = logging.getLogger(__name__)

# GGUF leaf name -> HF parameter name (``{i}`` is the layer index), as llama.cpp names Llama's.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp wrote one ``general.architecture``: the family that serves it, whether the
    q/k rows are permuted, its layer tensors' names, and the shift added to its norm weights."""

    family: str
    permuted_qk: bool = False
    layer_names: dict[str, str] = dataclass_field(default_factory=lambda: dict(_LAYER_NAMES))
    norm_shift: float = 0.0


_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The architectures this loader reads.
GGUF_ARCHS = {
    "llama": GGUFArch("llama", permuted_qk=True),
    "qwen2": GGUFArch("llama"),
    "qwen3": GGUFArch("qwen3"),
    "gemma3": GGUFArch("gemma3", layer_names=_GEMMA3_LAYER_NAMES, norm_shift=1.0),
}
# llama.cpp's Gemma 3 numbers that older files do not carry (src/models/gemma3.cpp).
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is hidden / heads, not head_dim


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


def gguf_arch(reader: GGUFFile) -> GGUFArch:
    """The file's architecture as this loader reads it, or ``UnsupportedModelError`` naming
    those it reads."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    return GGUF_ARCHS[arch]


def read_arch_config(reader: GGUFFile) -> ModelArchConfig:
    """Architecture numbers from ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    family = gguf_arch(reader).family
    arch = field(reader, "general.architecture")
    num_heads = field(reader, f"{arch}.attention.head_count")
    hidden = field(reader, f"{arch}.embedding_length")
    num_layers = field(reader, f"{arch}.block_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"])
    head_dim = (
        field(reader, f"{arch}.attention.key_length")
        or field(reader, f"{arch}.rope.dimension_count")
        or hidden // num_heads
    )
    gemma = (
        _gemma3_numbers(reader, arch, num_layers, hidden // num_heads, head_dim) if family == "gemma3" else {}
    )
    return ModelArchConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=field(reader, f"{arch}.context_length", 4096),
        # llama.cpp drops output.weight when it is the embedding (as transformers concludes too).
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        rope_scaling=_rope_scaling(reader, arch),
        family=family,
        **gemma,
    )


def _gemma3_numbers(
    reader: GGUFFile, arch: str, num_layers: int, hidden_per_head: int, head_dim: int
) -> dict:
    """Gemma 3's sliding window, its layers, the local RoPE base and the attention scale, as
    llama.cpp reads them (``src/models/gemma3.cpp``): what the file lacks is llama.cpp's default."""
    window = field(reader, f"{arch}.attention.sliding_window")
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # one flag per layer
        sliding = tuple(bool(flag) for flag in pattern)
    else:  # every pattern-th layer attends to every key
        sliding = tuple(i % pattern < pattern - 1 for i in range(num_layers))
    has_window = bool(window) and any(sliding)
    return {
        "sliding_window": int(window) if has_window else None,
        "sliding_layers": sliding if has_window else None,
        "rope_local_theta": float(field(reader, f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": float(hidden_per_head if num_layers == _GEMMA3_27B_LAYERS else head_dim),
        "final_logit_softcapping": field(reader, f"{arch}.final_logit_softcapping"),
    }


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


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{leaf}.{weight|bias}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _gguf_tensors(reader: GGUFFile, arch: GGUFArch) -> list[tuple[GGUFTensor, str]]:
    """``(tensor, HF name)`` for every tensor the model has a parameter for."""
    names = arch.layer_names
    wanted = [(t, name) for t in reader.tensors if (name := _hf_name(t.name, names)) is not None]
    skipped = sorted(t.name for t in reader.tensors if _hf_name(t.name, names) is None)
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
    """Dequantised weights under HF names (unfused), q/k un-permuted, norm shifts undone."""
    reader = reader if reader is not None else open_gguf(path)
    torch_dtype = parse_dtype(dtype)
    config = read_arch_config(reader)
    arch = gguf_arch(reader)

    def convert(item: tuple[GGUFTensor, str]) -> tuple[str, torch.Tensor]:
        tensor, name = item
        return name, _dequantized(tensor, name, config, arch).to(torch_dtype)

    # numpy releases the GIL in the dequantisation kernels, so two threads nearly halve the time.
    with ThreadPoolExecutor(max_workers=max(1, min(4, torch.get_num_threads()))) as pool:
        state = dict(pool.map(convert, _gguf_tensors(reader, arch)))
    return config, state


def _fused_names(config: ModelArchConfig) -> list[tuple[str, tuple[str, ...]]]:
    """``(fused weight name, its HF parts)`` for every layer (q/k/v and gate/up)."""
    return [
        (f"model.layers.{i}.{fused}.weight", tuple(f"model.layers.{i}.{part}.weight" for part in parts))
        for i in range(config.num_layers)
        for fused, parts in FUSED_PROJECTIONS.items()
    ]


def _split_groups(
    hf_blocks: dict[str, torch.Tensor],
    kinds: dict[str, BlockKind],
    hf_dense: dict[str, torch.Tensor],
    config: ModelArchConfig,
) -> dict[str, list[BlockPart]]:
    """The fused groups whose parts are blocks of different kinds (llama.cpp's "_M" files: a Q6_K
    v beside a Q4_K q and k), taken out of ``hf_blocks`` as parts: ``{fused weight name: [(kind,
    blocks), ...]}``, consecutive parts of one kind stacked into one. A group only some of whose
    parts are blocks (a kind with no kernel) moves to ``hf_dense``, decoded, so that each group
    is fused from one side only."""
    split: dict[str, list[BlockPart]] = {}
    for fused, parts in _fused_names(config):
        held = [part for part in parts if part in hf_blocks]
        if not held:
            continue
        if len(held) < len(parts):
            expanded_bytes = 0
            for part in held:
                blocks, kind = hf_blocks.pop(part), kinds.pop(part)
                expanded_bytes += blocks.numel() * blocks.element_size()
                hf_dense[part] = dequantize_ref(kind, blocks, _in_features(kind, blocks))
            logger.info(
                "%s: some parts have no kernel, served dense (%s: %.1f MB of blocks expanded)",
                ", ".join(parts),
                ", ".join(held),
                expanded_bytes / 1e6,
            )
        elif len({kinds[part] for part in parts}) > 1:
            runs: list[tuple[BlockKind, list[torch.Tensor]]] = []
            for part in parts:
                kind, blocks = kinds.pop(part), hf_blocks.pop(part)
                if runs and runs[-1][0] is kind:
                    runs[-1][1].append(blocks)
                else:
                    runs.append((kind, [blocks]))
            split[fused] = [
                (kind, torch.cat(pieces) if len(pieces) > 1 else pieces[0]) for kind, pieces in runs
            ]
    return split


# The file types held in --dtype by design (F16 and BF16 are the dense weights themselves).
FLOAT_TYPES = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
)


def log_expanded(expanded: dict[str, list[GGUFTensor]], dtype: torch.dtype) -> None:
    """One line per quantized kind this load expands to dense weights: its tensors and bytes,
    in the file and as held. A kind expanded costs memory and the fast decode path, so it is
    said by name (a kind with no kernel, or no vector kernel on this CPU)."""
    for kind, tensors in sorted(expanded.items()):
        file_bytes = sum(t.n_bytes for t in tensors)
        held_bytes = sum(t.n_elements for t in tensors) * torch.finfo(dtype).bits // 8
        names = [t.name for t in tensors]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        logger.info(
            "%s expanded to dense %s: %d tensors (%s), %.1f MB in the file, %.1f MB held",
            kind,
            dtype,
            len(tensors),
            shown,
            file_bytes / 1e6,
            held_bytes / 1e6,
        )


def _in_features(kind: BlockKind, blocks: torch.Tensor) -> int:
    return blocks.shape[1] // kind.block_bytes * kind.block_weights


def _dequantized(tensor: GGUFTensor, name: str, config: ModelArchConfig, arch: GGUFArch) -> torch.Tensor:
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    heads = _qk_heads(name, config) if arch.permuted_qk else None
    if heads is not None:
        weight = unpermute_qk(weight, heads)
    if arch.norm_shift and tensor.name.endswith("norm.weight"):  # as transformers' Gemma2TensorProcessor
        weight = weight.astype(np.float32) - np.float32(arch.norm_shift)
    # np.array copies out of the read-only memmap; torch then owns the memory.
    return torch.from_numpy(np.array(weight, dtype=np.float32))


def load_gguf_blocks(
    path: str, dtype: str | torch.dtype = "float32", reader: GGUFFile | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor], BlockState]:
    """The file's weights as they are, for ``--quantization gguf``: ``(config, dense, blocks)``.

    ``blocks`` maps this model's parameter names (fused q/k/v and gate/up) to kernel blocks
    (see ``gguf_blocks``); ``dense`` holds the rest (norms, F16/BF16/F32 tensors) dequantised to
    ``dtype``. A fused projection whose parts differ in type (a Q4_K q with a Q6_K v, as
    llama.cpp's mixed "_M" files have) is held as parts, each in its own kind.
    """
    reader = reader if reader is not None else open_gguf(path)
    torch_dtype = parse_dtype(dtype)
    config = read_arch_config(reader)
    arch = gguf_arch(reader)
    hf_dense: dict[str, torch.Tensor] = {}
    hf_blocks: dict[str, torch.Tensor] = {}
    kinds: dict[str, BlockKind] = {}
    held_kinds = {t: kind for t, kind in KERNEL_KIND.items() if not kind.as_gguf or cpu_quant.k_route()}
    dense_kinds = [t.name for t in KERNEL_KIND if t not in held_kinds]
    if dense_kinds:
        logger.info("no vector kernels for %s on this CPU (no AVX-512): held dense", ", ".join(dense_kinds))
    expanded: dict[str, list[GGUFTensor]] = {}  # quantized kind -> its tensors held dense
    for tensor, name in _gguf_tensors(reader, arch):
        rows, in_features = (int(n) for n in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        if tensor.tensor_type not in held_kinds or not name.endswith(".weight") or rows == 0:
            hf_dense[name] = _dequantized(tensor, name, config, arch)
            if tensor.tensor_type not in FLOAT_TYPES:
                expanded.setdefault(tensor.tensor_type.name, []).append(tensor)
            continue
        kind, blocks = to_kernel_blocks(tensor.tensor_type, tensor.data, rows, in_features)
        heads = _qk_heads(name, config) if arch.permuted_qk else None
        if heads is not None:
            blocks = permute_block_rows(blocks, unpermute_qk(np.arange(rows), heads))
        hf_blocks[name], kinds[name] = blocks, kind
    split = _split_groups(hf_blocks, kinds, hf_dense, config)
    log_expanded(expanded, torch_dtype)
    fused_kinds = {name: kinds[parts[0]] for name, parts in _fused_names(config) if parts[0] in hf_blocks}
    block_state: BlockState = {
        name: (fused_kinds[name] if name in fused_kinds else kinds[name], blocks)
        for name, blocks in hf_to_model_state_dict(hf_blocks, config).items()
    }
    block_state.update(split)
    dense = hf_to_model_state_dict(hf_dense, config)
    return config, {name: t.to(torch_dtype) for name, t in dense.items()}, block_state


def load_gguf(
    path: str, dtype: str | torch.dtype = "float32", reader: GGUFFile | None = None
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` ready for ``LlamaForCausalLM.load_state_dict``."""
    config, hf_state = load_gguf_hf_state_dict(path, dtype, reader)
    return config, hf_to_model_state_dict(hf_state, config)
