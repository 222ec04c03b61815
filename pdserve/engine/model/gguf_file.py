"""A GGUF file's metadata and tensor table, read in a fraction of a second.

Why not ``gguf.GGUFReader``: it builds a numpy view for every part of every metadata value, and
the bundled model's 49k-token vocabulary plus 49k merges make that 3.4 s on this machine, about
14 s when four engines start at once on two cores. Every engine start paid it. This module reads
the same header with ``struct`` (strings decoded straight out of the memory map) and hands out
tensor data as the very views ``GGUFReader`` does (quantized types as ``uint8`` rows of block
bytes, in numpy ``[out, in]`` order), so ``gguf.quants.dequantize`` still decodes them; the
``gguf`` package stays the source of the type table. Only little-endian files (what llama.cpp
writes) are read; a big-endian or damaged file fails with a message naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF scalar value type -> struct format (little-endian).
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types whose data are plain numbers (anything else is handed out as block bytes).
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. ``shape`` is GGUF's order (innermost first, as ``GGUFReader``);
    ``data`` is a read-only view of the memory map in numpy order."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The metadata (``fields``: key -> plain Python value) and tensors of one GGUF file.

    Array values come back as lists (strings decoded as UTF-8), scalars as int/float/bool/str,
    the same values ``GGUFReader``'s ``field.contents()`` gives.
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._map = np.memmap(self.path, mode="r")
        self._buffer = self._map.data  # a memoryview: struct and str() read it without copies
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as error:
            raise ValueError(f"{self.path}: damaged GGUF header ({error})") from error

    def _parse(self) -> None:
        buffer = self._buffer
        if bytes(buffer[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buffer[:4])!r})")
        self.version = _U32.unpack_from(buffer, 4)[0]
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise ValueError(f"{self.path}: GGUF version {self.version} not supported{hint}")
        tensor_count, kv_count = struct.unpack_from("<QQ", buffer, 8)
        self._offset = 24
        # {key: value}, in file order
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            value_type = self._u32()
            self.fields[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self._offset // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.path}: a tensor name appears twice")

    # ---- header primitives ---------------------------------------------------------------------

    def _u32(self) -> int:
        value = _U32.unpack_from(self._buffer, self._offset)[0]
        self._offset += 4
        return value

    def _u64(self) -> int:
        value = _U64.unpack_from(self._buffer, self._offset)[0]
        self._offset += 8
        return value

    def _string(self) -> str:
        length = self._u64()
        start = self._offset
        self._offset += length
        if self._offset > len(self._buffer):
            raise IndexError("string runs past the end of the file")
        return str(self._buffer[start : self._offset], "utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            item_type = self._u32()
            count = self._u64()
            if item_type in _SCALAR_FORMATS:
                # One numpy read for a numeric array, whatever its length.
                dtype = np.dtype(_SCALAR_FORMATS[GGUFValueType(item_type)])
                end = self._offset + count * dtype.itemsize
                if end > len(self._buffer):
                    raise IndexError("array runs past the end of the file")
                items = np.frombuffer(self._buffer[self._offset : end], dtype=dtype).tolist()
                self._offset = end
                return items
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        layout = struct.Struct(_SCALAR_FORMATS[GGUFValueType(value_type)])
        value = layout.unpack_from(self._buffer, self._offset)[0]
        self._offset += layout.size
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._u32()
        shape = tuple(self._u64() for _ in range(n_dims))
        raw_type = self._u32()
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown type {raw_type}") from None
        return name, shape, tensor_type, self._u64()

    def _tensor(
        self, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        if start + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        numpy_shape = tuple(reversed(shape))
        plain = _PLAIN_TENSOR_DTYPES.get(tensor_type)
        if plain is None:
            data = self._map[start : start + n_bytes].reshape(
                quant_shape_to_byte_shape(numpy_shape, tensor_type)
            )
        else:
            data = self._map[start : start + n_bytes].view(plain).reshape(numpy_shape)
        return GGUFTensor(name, tensor_type, shape, n_elements, n_bytes, start, data)

    # ---- lookups -------------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file does not have ``key``."""
        return self.fields.get(key, default)

    def tensor(self, name: str) -> GGUFTensor | None:
        """The tensor called ``name``, or None."""
        return next((t for t in self.tensors if t.name == name), None)
