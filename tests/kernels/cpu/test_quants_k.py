"""The kinds held exactly as GGUF stores them (``kernels/cpu/csrc/quants_k.c``): Q4_0, Q5_0, Q5_1,
Q4_K, Q5_K and Q6_K, against ``gguf``'s own dequantization of the same bytes.

The bytes are random (every bit pattern of the quants, the scales and the high bits) with sane
fp16 scales, and, for the kinds ``gguf`` quantizes, its quantizer's output too. The weights must
be ``gguf``'s bit for bit (fp32) and its values rounded once (bf16); the matmuls must equal an fp64
matmul of those weights to fp32 rounding (fp32 x), the same of the bf16 x up to the output's bf16
rounding (bf16 x), and ``quant_matmul_a8_ref`` (int8 x); and a row's result must not depend on
the rows batched with it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")

GGML_OF = {
    BlockKind.Q4_0: GGML.Q4_0,
    BlockKind.Q5_0: GGML.Q5_0,
    BlockKind.Q5_1: GGML.Q5_1,
    BlockKind.Q4_K: GGML.Q4_K,
    BlockKind.Q5_K: GGML.Q5_K,
    BlockKind.Q6_K: GGML.Q6_K,
}
KINDS = list(GGML_OF)
OUT_FEATURES, IN_FEATURES = 40, 768  # three K-quant super-blocks a row
# fp16 fields per kind: (offset, spread) of each scale the random bytes must hold sanely
_SCALES = {
    BlockKind.Q4_0: [(0, 0.01)],
    BlockKind.Q5_0: [(0, 0.01)],
    BlockKind.Q5_1: [(0, 0.01), (2, 0.1)],
    BlockKind.Q4_K: [(0, 0.002), (2, 0.004)],
    BlockKind.Q5_K: [(0, 0.002), (2, 0.004)],
    BlockKind.Q6_K: [(208, 0.001)],
}


def random_blocks(kind: BlockKind, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """``rows`` rows of random ``kind`` blocks whose fp16 scales are finite and small."""
    rng = np.random.default_rng(seed)
    count = rows * in_features // kind.block_weights
    raw = rng.integers(0, 256, (count, kind.block_bytes), dtype=np.uint8)
    for offset, spread in _SCALES[kind]:
        values = rng.uniform(-spread, spread, count).astype(np.float16)
        raw[:, offset : offset + 2] = values.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def gguf_weights(kind: BlockKind, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``gguf.quants.dequantize`` of the bytes: what the file's weights are."""
    values = gguf.quants.dequantize(blocks.numpy(), GGML_OF[kind])
    return torch.from_numpy(values.reshape(blocks.shape[0], in_features).astype(np.float32))


@pytest.fixture(params=KINDS, ids=lambda kind: kind.name)
def kind(request) -> BlockKind:
    return request.param


@pytest.fixture
def weight(kind) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = random_blocks(kind, OUT_FEATURES, IN_FEATURES)
    return blocks, gguf_weights(kind, blocks, IN_FEATURES)


def test_rows_take_the_files_bytes(kind, weight):
    blocks, _ = weight
    assert kind.as_gguf and not kind.interleaved and kind.plain is kind
    assert (
        blocks.shape[1] == kind.row_bytes(IN_FEATURES) == IN_FEATURES // kind.block_weights * kind.block_bytes
    )
    numpy_type_size = gguf.GGML_QUANT_SIZES[GGML_OF[kind]]
    assert (kind.block_weights, kind.block_bytes) == numpy_type_size


def test_reference_and_kernel_decode_to_ggufs_values_bit_for_bit(kind, weight):
    blocks, reference = weight
    assert torch.equal(cpu_quant.dequantize_ref(kind, blocks, IN_FEATURES), reference)
    decoded = cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32)
    assert torch.equal(decoded, reference)
    as_bf16 = cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.bfloat16)
    assert torch.equal(as_bf16, reference.bfloat16())
    rows = torch.tensor([3, 0, 39, 3])
    looked_up = cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32, rows=rows)
    assert torch.equal(looked_up, reference[rows])


@pytest.mark.parametrize("kind", [BlockKind.Q4_0, BlockKind.Q5_0, BlockKind.Q5_1], ids=lambda kind: kind.name)
def test_ggufs_own_quantizer_output_decodes_the_same(kind):
    """(gguf quantizes these three; its K-quants are dequantize-only.)"""
    values = np.random.default_rng(3).standard_normal((8, IN_FEATURES)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(values, GGML_OF[kind])
    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    reference = gguf_weights(kind, blocks, IN_FEATURES)
    assert torch.equal(cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32), reference)
    assert float((reference - torch.from_numpy(values)).abs().max()) < 0.05  # it is a quantization of values


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_fp32_matmul_equals_the_weights_matmul(kind, weight, rows):
    blocks, reference = weight
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))
    out = cpu_quant.quant_matmul(x, kind, blocks, IN_FEATURES)
    expected = (x.double() @ reference.double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_bf16_matmul_equals_the_weights_matmul(kind, weight, rows):
    blocks, reference = weight
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = cpu_quant.quant_matmul(x, kind, blocks, IN_FEATURES)
    assert out.dtype == torch.bfloat16
    # every route multiplies the file's exact weights (bf16 x widened, or q exact in bf16 with
    # d and m in fp32): within fp32 summation and the output's own bf16 rounding (half an ulp)
    expected = x.double() @ reference.double().T
    scale = float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_are_exact_and_do_not_depend_on_their_batch(kind, dtype):
    """Rows of several 2048-input chunks (the bf16 route takes one row of x along whole rows and
    larger batches chunk by chunk), the last chunk partial, and for blocks of 32 a last 1-3
    blocks short of the four a step decodes."""
    in_features = 4864 if kind.block_weights == 256 else 4640
    blocks = random_blocks(kind, 24, in_features, seed=7)
    reference = gguf_weights(kind, blocks, in_features).double()
    x = torch.randn(19, in_features, generator=torch.Generator().manual_seed(7)).to(dtype)
    batched = cpu_quant.quant_matmul(x, kind, blocks, in_features)
    expected = x.double() @ reference.T
    scale = float(expected.abs().max())
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(batched.double(), expected, rtol=rtol, atol=1e-5 * scale)
    for size in (1, 2, 9):
        assert torch.equal(cpu_quant.quant_matmul(x[:size], kind, blocks, in_features), batched[:size])


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_int8_activation_matmul_equals_its_reference(kind, weight, rows):
    blocks, reference = weight
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(10 + rows))
    out = cpu_quant.quant_matmul(x, kind, blocks, IN_FEATURES, int8_activations=True)
    expected = cpu_quant.quant_matmul_a8_ref(x, kind, blocks, IN_FEATURES)
    exact = x.double() @ reference.double().T
    scale = float(exact.abs().max())
    assert float((out - expected).abs().max()) <= 1e-5 * scale  # fp32 rounding of the same sums
    assert float((out.double() - exact).abs().max()) <= 2e-2 * scale  # x's int8 rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(kind, weight, dtype, int8_activations):
    blocks, _ = weight
    x = torch.randn(16, IN_FEATURES, generator=torch.Generator().manual_seed(5)).to(dtype)
    batched = cpu_quant.quant_matmul(x, kind, blocks, IN_FEATURES, int8_activations=int8_activations)
    for size in (1, 3, 7):
        alone = cpu_quant.quant_matmul(x[:size], kind, blocks, IN_FEATURES, int8_activations=int8_activations)
        assert torch.equal(alone, batched[:size])


def test_rows_of_a_k_quant_must_be_whole_super_blocks():
    blocks = random_blocks(BlockKind.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu_quant.check_blocks(BlockKind.Q4_K, blocks, 224)
    with pytest.raises(ValueError, match="do not hold"):
        cpu_quant.check_blocks(BlockKind.Q6_K, blocks, 256)


@pytest.mark.parametrize(
    ("kind", "in_features"),
    [
        (BlockKind.Q4_0, 288),
        (BlockKind.Q5_0, 224),
        (BlockKind.Q5_1, 800),
        (BlockKind.Q4_K, 2304),
        (BlockKind.Q6_K, 4096),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int8_activation_matmul_of_rows_of_any_length(kind, in_features, rows):
    """Rows whose blocks do not fill the vector kernels' units of 256 weights (the small kinds),
    and longer rows, at batch sizes that take every tile: each row as it would be alone."""
    blocks = random_blocks(kind, 13, in_features, seed=in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = cpu_quant.quant_matmul(x, kind, blocks, in_features, int8_activations=True)
    expected = cpu_quant.quant_matmul_a8_ref(x, kind, blocks, in_features)
    exact = x.double() @ gguf_weights(kind, blocks, in_features).double().T
    assert float((out - expected).abs().max()) <= 1e-5 * float(exact.abs().max())
    for row in (0, rows - 1):
        alone = cpu_quant.quant_matmul(x[row : row + 1], kind, blocks, in_features, int8_activations=True)
        assert torch.equal(alone, out[row : row + 1])
