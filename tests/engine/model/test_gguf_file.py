"""pdserve's GGUF header reader against the ``gguf`` package's own ``GGUFReader``.

The fast reader replaced ``GGUFReader`` at every model load, so it must hand out the same
metadata values and the same tensor views (block bytes included), and fail clearly on a file
that is not GGUF or was cut short.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pdserve.engine.model.gguf_file import GGUFFile
from pdserve.engine.model.loader import bundled_model_path


def assert_same_as_gguf_reader(path: str) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {key: item.contents() for key, item in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields == expected
    assert list(ours.fields) == list(expected)  # file order kept
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in reference.shape), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            reference.n_elements,
            reference.n_bytes,
            reference.data_offset,
        ), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
    return ours


def test_bundled_model_reads_the_same_as_gguf_reader():
    ours = assert_same_as_gguf_reader(bundled_model_path())
    assert len(ours.field("tokenizer.ggml.tokens")) == 49152
    assert ours.field("general.architecture") == "llama"
    assert ours.tensor("blk.0.attn_q.weight").tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert ours.tensor("no.such.tensor") is None
    assert ours.field("no.such.key", 7) == 7


@pytest.fixture
def written(tmp_path):
    """A small file with every metadata value type and plain and quantized tensors."""
    path = str(tmp_path / "every_type.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((2, 32)).astype(np.float16))
    writer.add_tensor("plain.i32", np.arange(10, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_type_reads_the_same(written):
    ours = assert_same_as_gguf_reader(written)
    assert ours.field("t.str") == "héllo ✓"
    assert ours.field("t.strs") == ["a", "", "ünï"]
    assert ours.field("t.u64") == 2**63
    assert ours.field("t.bool") is True
    blocks = ours.tensor("blocks.q8_0")
    assert blocks.data.dtype == np.uint8 and blocks.data.shape == (4, 2 * 34)
    np.testing.assert_array_equal(ours.tensor("plain.i32").data, np.arange(10))


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))


def test_unsupported_version_is_refused(tmp_path, written):
    data = bytearray(Path(written).read_bytes())
    data[4:8] = (9).to_bytes(4, "little")
    path = tmp_path / "v9.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="version 9 not supported"):
        GGUFFile(str(path))


@pytest.mark.parametrize("keep", [40, 300])
def test_truncated_file_fails_with_its_name(tmp_path, written, keep):
    """Cut in the metadata (40 bytes) or in the tensor data: a clear error, not a numpy one."""
    data = Path(written).read_bytes()
    keep = keep if keep < 100 else len(data) - keep
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="cut.gguf"):
        GGUFFile(str(path))
