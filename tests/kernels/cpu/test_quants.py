"""The quantized-weight CPU kernels (``kernels/cpu/csrc/quants.c``) against dequantize-then-matmul.

GGUF blocks come from ``gguf``'s own quantizer where it has one (Q8_0, Q4_0, Q4_1) and from
random bytes with sane scales otherwise (Q4_K), and ``gguf.quants.dequantize`` of the same bytes
is the reference for what the weights are. The kernels then must equal an fp32 matmul with those
weights: to fp32 rounding for fp32 activations, and, for bf16 activations, to the matmul of the
bf16-rounded weights (what a dense bf16 copy of the same file computes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.engine.model.gguf_blocks import quantize_q8_0, to_kernel_blocks
from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS, QuantEmbedding, QuantLinear
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind

# Only a missing compiler skips: a source that fails to build must fail here, not fall back quietly.
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")

OUT_FEATURES, IN_FEATURES = 72, 512  # Q4_K needs rows of whole 256s


def gguf_tensor(kind: GGML, rng: np.random.Generator) -> np.ndarray:
    """A ``[OUT, IN]`` tensor of ``kind`` as GGUF bytes."""
    weights = rng.standard_normal((OUT_FEATURES, IN_FEATURES)).astype(np.float32) * 0.05
    if kind != GGML.Q4_K:
        return gguf.quants.quantize(weights, kind)
    block_bytes, per_block = 144, 256
    raw = rng.integers(0, 256, (OUT_FEATURES, IN_FEATURES // per_block, block_bytes), dtype=np.uint8)
    raw[..., 0:2] = (
        (rng.random((OUT_FEATURES, IN_FEATURES // per_block, 1)) * 0.002).astype(np.float16).view(np.uint8)
    )
    raw[..., 2:4] = (
        (rng.random((OUT_FEATURES, IN_FEATURES // per_block, 1)) * 0.004).astype(np.float16).view(np.uint8)
    )
    return raw.reshape(OUT_FEATURES, -1)


@pytest.fixture(params=[GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q4_K], ids=lambda t: t.name)
def ggml_weight(request) -> tuple[GGML, np.ndarray, torch.Tensor]:
    """``(type, its GGUF bytes, gguf's own fp32 dequantization)``."""
    raw = gguf_tensor(request.param, np.random.default_rng(7))
    reference = torch.from_numpy(
        gguf.quants.dequantize(raw, request.param).reshape(OUT_FEATURES, IN_FEATURES)
    )
    return request.param, raw, reference.float()


def test_blocks_hold_the_files_weights(ggml_weight):
    ggml_type, raw, reference = ggml_weight
    kind, blocks = to_kernel_blocks(ggml_type, raw, OUT_FEATURES, IN_FEATURES)
    decoded = cpu_quant.dequantize_ref(kind, blocks, IN_FEATURES)
    assert torch.equal(decoded, reference)  # the same numbers, bit for bit
    # The C decoder agrees with the torch one, also gathering rows (the embedding lookup).
    assert torch.equal(cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32), decoded)
    rows = torch.tensor([5, 0, 71, 5])
    assert torch.equal(
        cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32, rows=rows), decoded[rows]
    )
    # Into a given buffer (prefill chunks reuse one), in bf16 rounded as torch rounds.
    out = torch.full((OUT_FEATURES, IN_FEATURES), float("nan"), dtype=torch.bfloat16)
    got = cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.bfloat16, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, decoded.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cpu_quant.quant_dequantize(kind, blocks, IN_FEATURES, torch.float32, out=out)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quant_linear_matches_dequantize_then_matmul(ggml_weight, rows, dtype):
    ggml_type, raw, _ = ggml_weight
    kind, blocks = to_kernel_blocks(ggml_type, raw, OUT_FEATURES, IN_FEATURES)
    weight = cpu_quant.dequantize_ref(kind, blocks, IN_FEATURES)
    # Seeded: the global generator's state depends on which tests ran before in this worker.
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(OUT_FEATURES, generator=gen)
    x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype)
    layer = QuantLinear(kind, blocks, IN_FEATURES, bias=bias.to(dtype))
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, OUT_FEATURES)
    if dtype == torch.float32:
        expected = x @ weight.T + bias
        torch.testing.assert_close(
            got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max()))
        )
    else:
        # bf16 activations, fp32 accumulation, one bf16 rounding of the output; the weights are
        # exact (1-3 rows) or rounded to bf16 (4 or more, as a dense bf16 copy would hold them).
        expected = x.float() @ weight.T + bias.bfloat16().float()
        scale = float(expected.abs().max())
        torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_kernel_and_gemm_paths_agree_around_the_switch():
    """Up to ``KERNEL_MAX_ROWS`` rows the C kernel runs, above it torch's GEMM: one row's result
    must not depend on how many rows came with it."""
    rng = np.random.default_rng(3)
    kind, blocks = to_kernel_blocks(GGML.Q4_1, gguf_tensor(GGML.Q4_1, rng), OUT_FEATURES, IN_FEATURES)
    layer = QuantLinear(kind, blocks, IN_FEATURES)
    x = torch.randn(KERNEL_MAX_ROWS + 1, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x[:KERNEL_MAX_ROWS]), layer(x)[:KERNEL_MAX_ROWS], rtol=1e-5, atol=1e-5)


def test_int8_blocks_are_ggmls_q8_0():
    weight = torch.randn(OUT_FEATURES, IN_FEATURES)
    blocks = quantize_q8_0(weight)
    assert np.array_equal(blocks.numpy(), gguf.quants.quantize(weight.numpy(), GGML.Q8_0))
    decoded = cpu_quant.dequantize_ref(BlockKind.Q8_0, blocks, IN_FEATURES)
    # Symmetric int8 with a scale per 32: within half a step (amax / 127 / 2) of each weight,
    # plus the scale's own fp16 rounding (2^-11 of it, times up to 127 steps).
    step = weight.reshape(OUT_FEATURES, -1, 32).abs().amax(-1, keepdim=True) / 127
    bound = step * (0.5 + 127 * 2**-11)
    assert ((decoded - weight).reshape(OUT_FEATURES, -1, 32).abs() <= bound).all()
    zeros = quantize_q8_0(torch.zeros(2, 64))  # an all-zero group has scale 0, not NaN
    assert torch.equal(cpu_quant.dequantize_ref(BlockKind.Q8_0, zeros, 64), torch.zeros(2, 64))


def test_quant_embedding_looks_up_decoded_rows():
    weight = torch.randn(50, 64)
    table = QuantEmbedding(BlockKind.Q8_0, quantize_q8_0(weight), 64, torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    decoded = cpu_quant.dequantize_ref(BlockKind.Q8_0, quantize_q8_0(weight), 64)
    got = table(ids)
    assert got.shape == (2, 2, 64) and got.dtype == torch.bfloat16
    assert torch.equal(got, decoded[ids].bfloat16())
    with pytest.raises(IndexError):
        table(torch.tensor([50]))


def test_bad_blocks_are_refused_with_a_clear_error():
    blocks = quantize_q8_0(torch.randn(4, 64))
    with pytest.raises(ValueError, match="do not hold"):
        QuantLinear(BlockKind.Q4_1, blocks, 64)  # Q8_0 bytes read as Q4_1
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_quant.quant_matmul(torch.randn(1, 60), BlockKind.Q8_0, blocks, 60)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_quant.quant_matmul(torch.randn(1, 64).half(), BlockKind.Q8_0, blocks, 64)
    with pytest.raises(ValueError, match="no kernel"):
        to_kernel_blocks(GGML.F16, np.zeros(512, dtype=np.uint8), 1, 256)
    with pytest.raises(ValueError, match="not whole blocks"):
        to_kernel_blocks(GGML.Q6_K, np.zeros(210, dtype=np.uint8), 2, 128)


def test_without_a_compiler_the_modules_fall_back_to_the_torch_reference(monkeypatch, tmp_path):
    """A host with no C compiler still serves quantized weights (slower), with the same results;
    a cache directory that cannot be written falls back to a temporary one."""
    rng = np.random.default_rng(5)
    kind, blocks = to_kernel_blocks(GGML.Q4_1, gguf_tensor(GGML.Q4_1, rng), OUT_FEATURES, IN_FEATURES)
    x = torch.randn(3, IN_FEATURES)
    with_kernel = QuantLinear(kind, blocks, IN_FEATURES)(x)
    table_blocks = quantize_q8_0(torch.randn(20, 64))
    looked_up = QuantEmbedding(BlockKind.Q8_0, table_blocks, 64, torch.float32)(torch.tensor([4, 19]))

    monkeypatch.setattr(cpu_quant.KERNELS, "_library", None)
    monkeypatch.setattr(cpu_quant.KERNELS, "_load_error", "no C compiler (cc, gcc or clang) on PATH")
    assert not cpu_quant.available()
    fallback = QuantLinear(kind, blocks, IN_FEATURES)
    assert not fallback.use_kernel
    torch.testing.assert_close(fallback(x), with_kernel, rtol=1e-5, atol=1e-5)
    fallback_table = QuantEmbedding(BlockKind.Q8_0, table_blocks, 64, torch.float32)
    assert not fallback_table.use_kernel
    assert torch.equal(fallback_table(torch.tensor([4, 19])), looked_up)

    # A cache path that cannot be made (a file in the way: as unwritable to root as to anyone).
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(blocker / "kernels"))
    assert cpu_build.cache_dir().parent == Path(tempfile.gettempdir())


@pytest.mark.parametrize("in_features", [32, 96, 608], ids=["1-block", "3-blocks", "19-blocks"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_odd_block_counts_and_partial_scale_groups(in_features, rows):
    """The kernels load two blocks' nibbles and 16 blocks' scales at a time: rows whose block count
    is odd, or not a multiple of 16, must not read past them (bf16: the pair-wise route)."""
    weights = np.random.default_rng(in_features).standard_normal((40, in_features)).astype(np.float32)
    kind, blocks = to_kernel_blocks(GGML.Q4_1, gguf.quants.quantize(weights, GGML.Q4_1), 40, in_features)
    reference = cpu_quant.dequantize_ref(kind, blocks, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    for dtype in (torch.float32, torch.bfloat16):
        got = cpu_quant.quant_matmul(x.to(dtype), kind, blocks, in_features).float()
        expected = x.to(dtype).float() @ reference.T
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("out_features", [7, 8, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_gets_the_same_result_in_any_batch(ggml_type, out_features, dtype):
    """One row's outputs are bit-identical alone, in pairs and in larger tiles (the kernels tile
    one or two rows over several output rows, larger batches over rows of x; every (row,
    output) pair sums in the same order, on one route whatever the batch), with output counts
    that leave a partial tile, in fp32 and in bf16 (on AVX512-BF16 CPUs bf16 takes a route of
    its own). A request's logits then do not depend on what it is batched with."""
    in_features = 608  # 19 blocks: an odd count and a partial group of 16 minima
    weights = (
        np.random.default_rng(out_features).standard_normal((out_features, in_features)).astype(np.float32)
    )
    kind, blocks = to_kernel_blocks(
        ggml_type, gguf.quants.quantize(weights, ggml_type), out_features, in_features
    )
    x = torch.randn(11, in_features, generator=torch.Generator().manual_seed(11)).to(dtype)
    together = cpu_quant.quant_matmul(x, kind, blocks, in_features)
    for i in range(len(x)):
        assert torch.equal(cpu_quant.quant_matmul(x[i : i + 1], kind, blocks, in_features)[0], together[i])
    for i in range(0, len(x) - 1, 2):
        assert torch.equal(
            cpu_quant.quant_matmul(x[i : i + 2], kind, blocks, in_features), together[i : i + 2]
        )
    expected = x.float() @ cpu_quant.dequantize_ref(kind, blocks, in_features).T
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: the output's own rounding
    torch.testing.assert_close(
        together.float(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max())
    )
