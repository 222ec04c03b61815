"""A tiny deterministic random model, written as a real HF checkpoint directory, for fast tests.

By default a Llama with GQA (4 query heads over 2 KV heads), an untied LM head, and its own small
byte-level BPE tokenizer (3 ChatML specials + 256 bytes + a few merges), so any text prompt
encodes and the vocab matmul stays cheap. Weights are scaled so the logits are peaked (std ~2):
greedy tests comparing two code paths then fail on bugs, not on float near-ties between random
tokens.

``variant`` picks another family or feature that pdserve serves (``TINY_VARIANTS``), each a
config transformers builds offline: Llama 3's RoPE scaling with tied embeddings, Mistral's
sliding window, Qwen2's q/k/v biases, Qwen3's qk-norm with its own ``head_dim``, and Gemma 3
(GeGLU, four ``1 + w`` norms a layer, qk-norm, five sliding layers to one global, two RoPE
bases). Shapes follow what a GGUF file can carry to transformers' reader too (its Qwen3 takes
``head_dim`` 128 and its Gemma 3 ``query_pre_attn_scalar`` 256 and one global layer in six,
whatever the file says), so a GGUF of each loads alike in pdserve and in transformers.
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


# Window of the tiny sliding-window variants: prompts of a few blocks already reach past it.
TINY_SLIDING_WINDOW = 32

# variant -> what its config.json changes from the tiny Llama's.
TINY_VARIANTS: dict[str, dict] = {
    "llama": {},
    "llama3": {  # Llama 3.1's scaling (original context 64: every prompt feels it), tied
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
    },  # fmt: skip
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": TINY_SLIDING_WINDOW,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 128,  # not hidden / heads (16)
        "use_sliding_window": False,
        "attention_bias": False,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": TINY_SLIDING_WINDOW,
        "sliding_window_pattern": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "tie_word_embeddings": True,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "max_position_embeddings": 2048,
    },
}


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

    gemma = cfg["model_type"] == "gemma3_text"

    def norm(size: int = hidden) -> torch.Tensor:  # near 1 but not 1, so a missing norm weight shows
        # Gemma's norms scale by 1 + w: their weights are near 0.
        return randn(size, std=0.1) + (0.0 if gemma else 1.0)

    # Gemma multiplies its embedding by sqrt(hidden): a table of std 1/sqrt(hidden) enters the
    # residual stream at std 1, like the others', so the layers' outputs are not drowned by it.
    state = {
        "model.embed_tokens.weight": randn(cfg["vocab_size"], hidden, std=hidden**-0.5 if gemma else 1.0)
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm()
        if cfg["model_type"] in ("qwen3", "gemma3_text"):
            state[p + "self_attn.q_norm.weight"] = norm(cfg["head_dim"])
            state[p + "self_attn.k_norm.weight"] = norm(cfg["head_dim"])
        if gemma:
            state[p + "pre_feedforward_layernorm.weight"] = norm()
            state[p + "post_feedforward_layernorm.weight"] = norm()
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
    # Gemma's tied LM head is that small table: a final norm of ~4 keeps its logits peaked.
    state["model.norm.weight"] = norm() + (3.0 if gemma else 0.0)
    if not tied:
        state["lm_head.weight"] = randn(cfg["vocab_size"], hidden, std=2.0 / math.sqrt(hidden))
    return state


def write_tiny_model(
    directory: str,
    seed: int = 0,
    dtype: str = "float32",
    *,
    num_layers: int | None = None,
    attention_bias: bool = False,
    tie_word_embeddings: bool = False,
    variant: str = "llama",
) -> str:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``directory`` and return it.

    ``variant`` is one of ``TINY_VARIANTS``; ``attention_bias=True`` means ``variant="qwen2"``.
    ``num_layers`` (default 2, Gemma 3's 6) and ``tie_word_embeddings`` override the variant's.
    Same arguments, same bytes: weights come from a ``torch.Generator`` seeded with ``seed``.
    """
    if attention_bias:
        variant = "qwen2"
    if variant not in TINY_VARIANTS:
        raise ValueError(f"tiny variant {variant!r} not in {sorted(TINY_VARIANTS)}")
    torch_dtype = parse_dtype(dtype)
    os.makedirs(directory, exist_ok=True)
    tokenizer = tiny_tokenizer()
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        **TINY_ARCH,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
        **TINY_VARIANTS[variant],
    }
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
        if "layer_types" in cfg:  # the variant's pattern, cut or repeated to the new depth
            pattern = TINY_VARIANTS[variant]["layer_types"]
            cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    if tie_word_embeddings:
        cfg["tie_word_embeddings"] = True
    if cfg["model_type"] == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    generator = torch.Generator().manual_seed(seed)
    state = _weights(cfg, generator, cfg["model_type"] == "qwen2", cfg["tie_word_embeddings"])
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
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
    return directory
