"""A tiny deterministic random Llama, written as a real HF checkpoint directory, for fast tests.

It has GQA (4 query heads over 2 KV heads), an untied LM head, and its own small byte-level BPE
tokenizer (3 ChatML specials + 256 bytes + a few merges), so any text prompt encodes and the
vocab matmul stays cheap. Weights are scaled so the logits are peaked (std ~2): greedy tests
comparing two code paths then fail on bugs, not on float near-ties between random tokens.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.tokenizer import byte_alphabet

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos)
# A few common English merges (byte-level spelling: "Ġ" is a space).
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "w"), ("Ġ", "c"), ("i", "s"), ("i", "t"),
    ("e", "s"), ("a", "n"), ("Ġ", "o"), ("Ġ", "i"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "p"), ("e", "d"),
    ("n", "d"), ("Ġa", "nd"), ("o", "u"), ("in", "g"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"),
]  # fmt: skip
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

TINY_ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}


def tiny_tokenizer() -> BackendTokenizer:
    """The tiny model's byte-level BPE (GPT-2 splitting, no prefix space)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in byte_alphabet().values():
        vocab[char] = len(vocab)
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = BackendTokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def _weights(
    cfg: dict, generator: torch.Generator, attention_bias: bool, tied: bool
) -> dict[str, torch.Tensor]:
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return randn(out_features, in_features, std=1.0 / math.sqrt(in_features))

    def norm() -> torch.Tensor:  # near 1 but not 1, so a missing norm weight shows
        return 1.0 + randn(hidden, std=0.1)

    state = {"model.embed_tokens.weight": randn(cfg["vocab_size"], hidden, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm()
        state[p + "self_attn.q_proj.weight"] = linear(q_out, hidden)
        state[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden)
        state[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        if attention_bias:
            state[p + "self_attn.q_proj.bias"] = randn(q_out, std=0.1)
            state[p + "self_attn.k_proj.bias"] = randn(kv_out, std=0.1)
            state[p + "self_attn.v_proj.bias"] = randn(kv_out, std=0.1)
        state[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        state[p + "post_attention_layernorm.weight"] = norm()
        state[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        state[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        state[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    state["model.norm.weight"] = norm()
    if not tied:
        state["lm_head.weight"] = randn(cfg["vocab_size"], hidden, std=2.0 / math.sqrt(hidden))
    return state


def write_tiny_model(
    directory: str,
    seed: int = 0,
    dtype: str = "float32",
    *,
    num_layers: int = 2,
    attention_bias: bool = False,
    tie_word_embeddings: bool = False,
) -> str:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``directory`` and return it.

    ``attention_bias=True`` writes a Qwen2 checkpoint (q/k/v biases) instead of a Llama one.
    Same arguments, same bytes: weights come from a ``torch.Generator`` seeded with ``seed``.
    """
    torch_dtype = parse_dtype(dtype)
    os.makedirs(directory, exist_ok=True)
    tokenizer = tiny_tokenizer()
    model_type = "qwen2" if attention_bias else "llama"
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        **TINY_ARCH,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
    }
    if model_type == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    generator = torch.Generator().manual_seed(seed)
    state = _weights(cfg, generator, attention_bias, tie_word_embeddings)
    state = {name: tensor.to(torch_dtype).contiguous() for name, tensor in state.items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_ARCH["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
    return directory
