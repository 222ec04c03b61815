"""Read a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``).

Covers the ``model_type``s of ``arch.SUPPORTED_MODEL_TYPES``: Llama-layout checkpoints (Llama,
SmolLM, Mistral), Qwen2 (q/k/v with bias), Qwen3 and Gemma 3 (text). HF's q/k rows are already in
the "rotate_half" layout our RoPE uses and Gemma's norm weights are HF's ``w`` of ``1 + w``, so
weights go in unchanged apart from fusing q/k/v and gate/up.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file

from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.weights import hf_to_model_state_dict


def read_hf_config(path: str) -> ModelArchConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return ModelArchConfig.from_hf_config(json.load(f))


def safetensors_files(path: str) -> list[str]:
    """The shard list from ``model.safetensors.index.json`` if present, else every ``*.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def load_hf_dir(
    path: str, dtype: str | torch.dtype = "float32"
) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` ready for ``LlamaForCausalLM.load_state_dict``."""
    torch_dtype = parse_dtype(dtype)
    config = read_hf_config(path)
    hf_state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(file).items():
            hf_state[name] = tensor.to(torch_dtype)
    return config, hf_to_model_state_dict(hf_state, config)
