"""A GGUF file of a tiny checkpoint (``pdserve.engine.model.tiny``), written with the ``gguf``
package's ``GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` writes it.

The tests do not run llama.cpp's converter (its source is not installed here), so this follows
it for the tiny variants, independently of pdserve's GGUF reader: the architecture name
(Mistral becomes ``llama`` and keeps no window), the metadata keys, the tensor names, q/k rows
permuted for ``llama`` (``LlamaModel.permute``), Llama 3's scaling baked into
``rope_freqs.weight`` (``LlamaModel.generate_extra_tensors``), Gemma 3's norms stored plus one
(``Gemma3Model.modify_tensors``) and its window with the local RoPE base, and the byte-level
BPE vocabulary. ``test_tiny_gguf_matches_llama_cpp_converter`` holds it to the real converter
where a llama.cpp source tree is at hand (``$PDSERVE_LLAMACPP_SRC``).
"""

from __future__ import annotations

import json
import math
import os

import gguf
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as BackendTokenizer

# HF model_type -> GGUF architecture, as convert_hf_to_gguf.py registers the classes.
GGUF_ARCH_OF = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}

# HF layer parameter -> GGUF leaf (gguf's TensorNameMap), Llama's and the others'.
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_CONTROL, _NORMAL = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL


def _permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF's rotate_half rows to GGML's pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama3_rope_factors(cfg: dict) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.generate_extra_tensors`` for rope_type llama3."""
    scaling = cfg["rope_scaling"]
    base = cfg.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _vocab(directory: str) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token types, merges)`` of the checkpoint's byte-level BPE (``_set_vocab_gpt2``)."""
    backend = BackendTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    vocab = backend.get_vocab(with_added_tokens=True)
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = [int(_CONTROL if token in special else _NORMAL) for token in tokens]
    with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_tiny_gguf(directory: str, path: str) -> str:
    """The GGUF of the tiny HF checkpoint in ``directory``, at ``path`` (all tensors F32)."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
        tokenizer_cfg = json.load(f)
    arch = GGUF_ARCH_OF[cfg["model_type"]]
    gemma = arch == "gemma3"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(os.path.basename(os.path.normpath(directory)).capitalize())
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_theta"])
    if gemma:
        writer.add_rope_freq_base_swa(cfg["rope_local_base_freq"])
        if cfg.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(cfg["sliding_window"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)

    tokens, types, merges = _vocab(directory)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split the tiny BPE uses
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(tokens.index(tokenizer_cfg["pad_token"]))
    writer.add_add_bos_token(bool(tokenizer_cfg.get("add_bos_token", False)))
    writer.add_chat_template(tokenizer_cfg["chat_template"])

    layer_tensors = _GEMMA3_LAYER_TENSORS if gemma else _LAYER_TENSORS
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg).numpy())
    for name, tensor in load_file(os.path.join(directory, "model.safetensors")).items():
        tensor = tensor.float()
        if name in _GLOBAL_TENSORS:
            gguf_name = _GLOBAL_TENSORS[name]
        else:
            _, _, layer, leaf = name.split(".", 3)  # model.layers.{i}.{leaf}
            gguf_name = f"blk.{layer}.{layer_tensors[leaf]}"
        if arch == "llama" and ".attn_q." in gguf_name:
            tensor = _permute(tensor, heads, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            tensor = _permute(tensor, heads, kv_heads)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma3RMSNorm scales by 1 + w; llama.cpp by the stored weight
        writer.add_tensor(gguf_name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
