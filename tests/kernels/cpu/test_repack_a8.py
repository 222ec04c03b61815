"""Weights interleaved 16 rows at a time for the int8-activation kernel (``kernels/cpu/csrc/repack_a8.c``).

``--quantization gguf-a8 / int8-a8`` holds its projections so on CPUs with AVX512-VNNI: Q4_1 and
Q8_0, and GGUF's Q4_0, Q5_0 and Q5_1 (the fifth bits in a vector of their own) and Q4_K (a
chunk a super-block, its packed scales in vectors of their own). The
layout moves the blocks' own bytes (undone exactly by ``deinterleave_rows``), the kernel computes
what the float64 reference does to fp32 rounding, in any batch the same bits for a row, and the
dequantization (prefill chunks, the tied embedding's lookups) decodes the same weights as from
the row-major blocks. Where the CPU has no VNNI the same kinds run a plain C loop: these tests
hold there too.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.layers.quant_linear import QuantEmbedding, QuantLinear
from pdserve.engine.model.weights import use_int8_activations, weight_bytes
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind
from tests.helpers.decoder_layer import random_gguf_blocks

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")

TYPES = [GGML.Q4_1, GGML.Q8_0, GGML.Q4_0, GGML.Q5_0, GGML.Q5_1, GGML.Q4_K]


def fit(ggml_type: GGML, in_features: int) -> int:
    """``in_features`` rounded up to whole blocks of the type (Q4_K's super-blocks of 256)."""
    block = 256 if ggml_type is GGML.Q4_K else 32
    return -(-in_features // block) * block


def kernel_blocks(ggml_type: GGML, out_features: int, in_features: int, seed: int = 5):
    """``(kind, blocks)`` of a random ``[out, in]`` weight quantized by gguf's own quantizer (for
    Q4_K, which it does not quantize, random super-blocks with scales that keep weights of that size)."""
    if ggml_type is GGML.Q4_K:
        gen = torch.Generator().manual_seed(seed)
        raw = random_gguf_blocks(ggml_type, out_features, in_features, gen)
        return to_kernel_blocks(ggml_type, raw, out_features, in_features)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32) * in_features**-0.5
    return to_kernel_blocks(ggml_type, gguf.quants.quantize(weights, ggml_type), out_features, in_features)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("in_features", [32, 576, 1536])
def test_interleaving_moves_the_blocks_bytes_and_nothing_else(ggml_type, in_features):
    in_features = fit(ggml_type, in_features)
    kind, blocks = kernel_blocks(ggml_type, 48, in_features)
    x16_kind, x16 = cpu_quant.interleave_rows(kind, blocks, in_features)
    assert x16_kind.interleaved and x16_kind.plain is kind and x16_kind.block_bytes == kind.block_bytes
    assert x16.shape == blocks.shape and x16.dtype == torch.uint8
    assert not torch.equal(x16, blocks)
    assert torch.equal(cpu_quant.deinterleave_rows(x16_kind, x16, in_features), blocks)
    torch.testing.assert_close(
        cpu_quant.dequantize_ref(x16_kind, x16, in_features),
        cpu_quant.dequantize_ref(kind, blocks, in_features),
        rtol=0,
        atol=0,
    )


def test_interleaving_refuses_what_it_cannot_lay_out():
    kind, blocks = kernel_blocks(GGML.Q4_1, 24, 64)  # 24 rows: not whole groups of 16
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_quant.interleave_rows(kind, blocks, 64)
    kind, blocks = kernel_blocks(GGML.Q4_1, 32, 64)
    x16_kind, x16 = cpu_quant.interleave_rows(kind, blocks, 64)
    with pytest.raises(ValueError, match="interleaved already"):
        cpu_quant.interleave_rows(x16_kind, x16, 64)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        cpu_quant.check_blocks(x16_kind, x16[:8].contiguous(), 64)
    with pytest.raises(ValueError, match="int8 or bf16 activations"):
        cpu_quant.quant_matmul(torch.randn(1, 64), x16_kind, x16, 64)
    kind, blocks = kernel_blocks(GGML.Q5_0, 32, 64)
    x16_kind, x16 = cpu_quant.interleave_rows(kind, blocks, 64)
    with pytest.raises(ValueError, match="with int8 activations only"):  # no bf16 kernel for these
        cpu_quant.quant_matmul(torch.randn(1, 64).bfloat16(), x16_kind, x16, 64)
    super_blocks = torch.randint(0, 256, (32, BlockKind.Q6_K.block_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="no interleaved layout"):
        cpu_quant.interleave_rows(BlockKind.Q6_K, super_blocks, 256)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 37])  # 37: prefill tiles and rows left over
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(16, 32), (48, 576), (32, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_computes_what_the_reference_does(ggml_type, rows, dtype, shape):
    out_features, in_features = shape[0], fit(ggml_type, shape[1])
    kind, blocks = cpu_quant.interleave_rows(
        *kernel_blocks(ggml_type, out_features, in_features), in_features
    )
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = cpu_quant.quant_matmul(x, kind, blocks, in_features, int8_activations=True)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = cpu_quant.quant_matmul_a8_ref(x.double(), kind, blocks, in_features)
    tolerance = 4e-6 if dtype == torch.float32 else 2**-8  # fp32 sums of up to 48 blocks; bf16 output
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_rows_result_is_the_same_in_any_batch(ggml_type):
    k = fit(ggml_type, 576)
    kind, blocks = cpu_quant.interleave_rows(*kernel_blocks(ggml_type, 48, k), k)  # 3 groups: one odd
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(11))
    whole = cpu_quant.quant_matmul(x, kind, blocks, k, int8_activations=True)
    # decode's tiles of 8 rows of x and what is left; prefill's (32 rows or more) and what is left
    for rows in (1, 3, 8, 9, 16, 32, 33, 37):
        part = cpu_quant.quant_matmul(x[-rows:], kind, blocks, k, int8_activations=True)
        assert torch.equal(part, whole[-rows:]), rows


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantizing_gives_the_row_major_blocks_weights(ggml_type, dtype):
    k = fit(ggml_type, 576)
    kind, blocks = kernel_blocks(ggml_type, 64, k)
    x16_kind, x16 = cpu_quant.interleave_rows(kind, blocks, k)
    whole = cpu_quant.quant_dequantize(x16_kind, x16, k, dtype)
    assert torch.equal(whole, cpu_quant.quant_dequantize(kind, blocks, k, dtype))
    ids = torch.tensor([63, 0, 17, 17, 30])  # lookups: any rows, repeated, in any order
    picked = cpu_quant.quant_dequantize(x16_kind, x16, k, dtype, rows=ids)
    assert torch.equal(picked, whole[ids])


def tied_model(in_features: int = 64, vocab: int = 48) -> torch.nn.Module:
    """A module holding a projection and a tied embedding / LM head pair, as ``install_blocks`` leaves
    a tied GGUF model: the head reads the embedding's block tensor."""
    model = torch.nn.Module()
    kind, blocks = kernel_blocks(GGML.Q4_1, 32, in_features)
    model.proj = QuantLinear(kind, blocks, in_features)
    table_kind, table = kernel_blocks(GGML.Q8_0, vocab, in_features, seed=9)
    model.embed = QuantEmbedding(table_kind, table, in_features, torch.float32)
    model.head = model.embed.as_linear()
    return model


@pytest.mark.skipif(not cpu_quant.x16_route(), reason="interleaving is for CPUs with AVX512-VNNI")
def test_int8_activations_interleave_the_projections_and_keep_the_table_shared():
    model = tied_model()
    before = weight_bytes(model)
    ids = torch.tensor([3, 47, 0])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    looked_up = model.embed(ids)
    use_int8_activations(model)
    assert model.proj.kind is BlockKind.Q4_1_X16 and model.head.kind is BlockKind.Q8_0_X16
    assert model.embed.kind is BlockKind.Q8_0_X16
    assert model.embed.blocks.data_ptr() == model.head.blocks.data_ptr()  # still one table
    assert weight_bytes(model) == before
    assert torch.equal(model.embed(ids), looked_up)
    want = cpu_quant.quant_matmul_a8_ref(x.double(), model.head.kind, model.head.blocks, 64)
    torch.testing.assert_close(model.head(x).double(), want, rtol=4e-6, atol=4e-6 * float(want.abs().max()))


@pytest.mark.skipif(not cpu_quant.x16_route(), reason="interleaving is for CPUs with AVX512-VNNI")
def test_gguf_blocks_of_32_are_interleaved_for_int8_activations_only():
    """Q5_0 (what an "_M" file holds where rows are not whole super-blocks) has an int8 kernel
    interleaved and none for bf16 activations: a bf16 model's interleaving leaves it row-major."""
    kind, blocks = kernel_blocks(GGML.Q5_0, 32, 576)
    bf16_model, int8_model = torch.nn.Module(), torch.nn.Module()
    bf16_model.proj, int8_model.proj = QuantLinear(kind, blocks, 576), QuantLinear(kind, blocks, 576)
    bf16_model.proj.interleave({})
    assert bf16_model.proj.kind is BlockKind.Q5_0
    use_int8_activations(int8_model)
    assert int8_model.proj.kind is BlockKind.Q5_0_X16 and int8_model.proj.int8_gemm
    x = torch.randn(
        20, 576, generator=torch.Generator().manual_seed(6)
    )  # a prefill chunk takes the kernel too
    want = cpu_quant.quant_matmul_a8_ref(x.double(), kind, blocks, 576)
    torch.testing.assert_close(
        int8_model.proj(x).double(), want, rtol=4e-6, atol=4e-6 * float(want.abs().max())
    )


@pytest.mark.skipif(not cpu_quant.x16_route(), reason="interleaving is for CPUs with AVX512-VNNI")
def test_a_prefill_chunk_over_parts_of_both_sorts_runs_each_its_own_way():
    """A Q4_K_M q/k/v: q and k Q4_K (interleaved, the int8 kernel), v Q6_K (no interleaved layout:
    decoded for torch's GEMM in the activations' dtype), side by side in one output."""
    gen = torch.Generator().manual_seed(7)
    parts = []
    for ggml_type, rows in ((GGML.Q4_K, 32), (GGML.Q6_K, 16)):
        parts.append(to_kernel_blocks(ggml_type, random_gguf_blocks(ggml_type, rows, 512, gen), rows, 512))
    model = torch.nn.Module()
    model.proj = QuantLinear.from_parts(parts, 512)
    use_int8_activations(model)
    assert model.proj.kinds == [BlockKind.Q4_K_X16, BlockKind.Q6_K] and not model.proj.int8_gemm
    x = torch.randn(20, 512, generator=gen)  # more rows than a decode batch: a prefill chunk
    got = model.proj(x).double()
    int8_part = cpu_quant.quant_matmul_a8_ref(x.double(), BlockKind.Q4_K, parts[0][1], 512)
    dense_part = x.double() @ cpu_quant.dequantize_ref(BlockKind.Q6_K, parts[1][1], 512).double().T
    for have, want in ((got[:, :32], int8_part), (got[:, 32:], dense_part)):
        torch.testing.assert_close(have, want, rtol=4e-6, atol=4e-6 * float(want.abs().max()))


def test_rows_that_are_not_whole_groups_stay_row_major():
    model = torch.nn.Module()
    kind, blocks = kernel_blocks(GGML.Q4_1, 24, 64)
    model.proj = QuantLinear(kind, blocks, 64)
    use_int8_activations(model)
    assert model.proj.kind is BlockKind.Q4_1 and model.proj.int8_activations
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    want = cpu_quant.quant_matmul_a8_ref(x.double(), kind, blocks, 64)
    torch.testing.assert_close(model.proj(x).double(), want, rtol=4e-6, atol=4e-6 * float(want.abs().max()))
