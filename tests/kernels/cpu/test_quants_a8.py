"""The int8-activation matmuls (``--quantization gguf-a8 / int8-a8``, ``kernels/cpu/csrc/quants_a8.c``).

They quantize x per block of 32 (llama.cpp's Q8_1, scales in fp32) and take integer dots with
the weights' blocks. The float64 reference (``cpu_quant.quant_matmul_a8_ref``) computes the same
quantization and the same sums: the kernel must equal it to fp32 rounding. The rounding x's
quantization adds must stay small against the fp32-activation kernel; a row's result must not
depend on the rows batched with it; and every block count (scale windows of 8 moved back at a
row's end, rows of fewer than 8 blocks, odd counts) and output count (tiles of 4) must be right.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS, QuantLinear
from pdserve.engine.model.weights import use_int8_activations
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import quant as cpu_quant

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")


def kernel_blocks(ggml_type: GGML, out_features: int, in_features: int, seed: int = 3):
    """``(kind, blocks)`` of a random ``[out, in]`` weight quantized by gguf's own quantizer."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32) * in_features**-0.5
    raw = gguf.quants.quantize(weights, ggml_type)
    return to_kernel_blocks(ggml_type, raw, out_features, in_features)


def test_activations_are_quantized_as_llama_cpps_q8_1():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)
    x[0, 31] = 7.9375  # max |x| = 127 / 16: d = 1 / 16 exactly
    x[0, 5], x[0, 6] = 2.5 / 16, 3.5 / 16  # halfway between steps: ties go to even (2, 4)
    q, d, s = cpu_quant.quantize_activations_ref(x)
    assert d[0, 0] == 1 / 16
    assert (q[0, 0, 31], q[0, 0, 5], q[0, 0, 6]) == (127, 2, 4)
    assert torch.equal(q[0, 1], torch.zeros(32)) and d[0, 1] == 0  # an all-zero block stays zero
    assert s[0, 0] == pytest.approx(float(d[0, 0] * q[0, 0].sum()))
    # The kernel rounds the same way: weights that pick out x[5] and x[6] (Q8_0: 127 steps of an
    # fp16 1/127, so 1 to 1e-4; rounding half away from zero would give 3/16 for x[5]).
    weight = torch.zeros(2, 64)
    weight[0, 5], weight[1, 6] = 1.0, 1.0
    raw = gguf.quants.quantize(weight.numpy(), GGML.Q8_0)
    kind, blocks = to_kernel_blocks(GGML.Q8_0, raw, 2, 64)
    got = cpu_quant.quant_matmul(x[:1], kind, blocks, 64, int8_activations=True)
    assert got[0].tolist() == pytest.approx([2 / 16, 4 / 16], rel=1e-3)


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_computes_what_the_reference_does(ggml_type, rows, dtype):
    out_features, in_features = 70, 576  # 18 blocks: a moved-back window; 70 = 17 tiles of 4 + 2
    kind, blocks = kernel_blocks(ggml_type, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = cpu_quant.quant_matmul(x, kind, blocks, in_features, int8_activations=True)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = cpu_quant.quant_matmul_a8_ref(x.double(), kind, blocks, in_features)
    tolerance = 2e-6 if dtype == torch.float32 else 2**-8  # the output's own rounding
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("in_features", [32, 64, 96, 256, 576, 608, 1536], ids=lambda k: f"{k // 32}-blocks")
@pytest.mark.parametrize("out_features", [1, 4, 7, 13])
def test_every_block_and_output_count(ggml_type, in_features, out_features):
    kind, blocks = kernel_blocks(ggml_type, out_features, in_features, seed=in_features + out_features)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(in_features))
    for rows in (1, 3):
        got = cpu_quant.quant_matmul(x[:rows], kind, blocks, in_features, int8_activations=True)
        want = cpu_quant.quant_matmul_a8_ref(x[:rows].double(), kind, blocks, in_features)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
def test_int8_activations_stay_close_to_fp32_activations(ggml_type):
    """x's rounding is at most half a step of 1/127 of its block's largest value: over a
    realistic row it moves the outputs by well under 1% of their spread."""
    kind, blocks = kernel_blocks(ggml_type, 256, 1536)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(11))
    exact = cpu_quant.quant_matmul(x, kind, blocks, 1536)
    rounded = cpu_quant.quant_matmul(x, kind, blocks, 1536, int8_activations=True)
    relative = float((rounded - exact).norm() / exact.norm())
    assert 0 < relative < 0.01, relative


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [7, 8, 13])
def test_a_rows_result_is_the_same_in_any_batch(ggml_type, out_features):
    kind, blocks = kernel_blocks(ggml_type, out_features, 608)
    x = torch.randn(9, 608, generator=torch.Generator().manual_seed(5))
    batched = cpu_quant.quant_matmul(x, kind, blocks, 608, int8_activations=True)
    for row in range(9):
        alone = cpu_quant.quant_matmul(x[row : row + 1], kind, blocks, 608, int8_activations=True)
        assert torch.equal(alone[0], batched[row]), row


def test_an_empty_batch_gets_an_empty_result():
    kind, blocks = kernel_blocks(GGML.Q4_1, 8, 64)
    got = cpu_quant.quant_matmul(torch.zeros(0, 64), kind, blocks, 64, int8_activations=True)
    assert got.shape == (0, 8)


def test_quant_linear_opts_in_for_its_kernels_rows():
    """``use_int8_activations`` switches the kernel's rows (decode batches); prefill chunks past
    the kernel's row limit run it too where the weights are interleaved (AVX512-VNNI), and
    elsewhere keep decoding the blocks for a GEMM in the activations' dtype."""
    kind, blocks = kernel_blocks(GGML.Q4_1, 64, 256)
    linear = QuantLinear(kind, blocks, 256)
    module = torch.nn.Sequential(linear)
    use_int8_activations(module)
    assert linear.int8_activations and "int8 activations" in repr(linear)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        linear(x[:4]),
        cpu_quant.quant_matmul_a8_ref(x[:4].double(), kind, blocks, 256).float(),
        rtol=2e-6,
        atol=1e-5,
    )
    if linear.int8_gemm:
        assert cpu_quant.x16_route() and x.shape[0] > KERNEL_MAX_ROWS
        want = cpu_quant.quant_matmul_a8_ref(x.double(), kind, blocks, 256).float()
        torch.testing.assert_close(linear(x), want, rtol=2e-6, atol=1e-5)
    else:
        torch.testing.assert_close(
            linear(x), cpu_quant.quant_matmul_ref(x, kind, blocks, 256), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ValueError, match="block-held weights"):
        use_int8_activations(torch.nn.Sequential(torch.nn.Linear(4, 4)))
