"""What a model file is made of: its tensor bytes by type, and the one-line share of each.

A GGUF "Q4_K_M" file is a mixture (llama-quantize picks a type per tensor, and falls back to
another where a row is not a whole number of 256-wide K-quant blocks, as SmolLM2's 576 is not),
so the name alone does not say which kernels a load of it will use; the shares do. Read with the
``gguf`` package's ``GGUFReader`` (which maps the file: nothing is loaded) and, for an HF
directory, from the safetensors headers.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter

# safetensors dtype -> the name a share line gives it (GGUF's spelling where there is one)
_SAFETENSORS_TYPES = {"BF16": "BF16", "F16": "F16", "F32": "F32", "F64": "F64", "I64": "I64", "I32": "I32"}


def gguf_type_bytes(path: str) -> dict[str, int]:
    """``{GGUF type name: bytes of the tensors of that type}`` in the file at ``path``."""
    import gguf

    totals: Counter[str] = Counter()
    for tensor in gguf.GGUFReader(path).tensors:
        totals[tensor.tensor_type.name] += int(tensor.n_bytes)
    return dict(totals)


def safetensors_type_bytes(directory: str) -> dict[str, int]:
    """The same for the ``*.safetensors`` files of an HF directory, from their JSON headers (an
    8-byte little-endian length, then ``{name: {dtype, shape, data_offsets}}``)."""
    totals: Counter[str] = Counter()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            start, end = info["data_offsets"]
            totals[_SAFETENSORS_TYPES.get(info["dtype"], info["dtype"])] += end - start
    return dict(totals)


def shares(type_bytes: dict[str, int]) -> str:
    """``Q4_K 55% Q6_K 42% F32 <1%``: each type's share of the tensor bytes, largest first."""
    total = sum(type_bytes.values())
    if total == 0:
        return "no tensors"
    parts = []
    for name, size in sorted(type_bytes.items(), key=lambda item: (-item[1], item[0])):
        percent = 100.0 * size / total
        parts.append(f"{name} {percent:.0f}%" if percent >= 0.5 else f"{name} <1%")
    return " ".join(parts)


def human_bytes(size: int) -> str:
    """``98.4 MiB``, ``1.9 GiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
