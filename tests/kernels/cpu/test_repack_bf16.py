"""Weight blocks interleaved 16 rows at a time against bf16 activations (``kernels/cpu/csrc/repack_bf16.c``).

A bf16 ``gguf`` model holds its Q4_1 projections and its Q8_0 LM head so where the CPU has
AVX512-BF16. The kernel must compute what the dequantize-then-matmul reference does to the
output's bf16 rounding, give a row the same bits in any batch, refuse fp32 x, and a fused decoder
layer over such weights must equal its per-op path. Without AVX512-BF16 the same kinds run a
plain loop: these tests hold there too.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.layers.quant_linear import QuantEmbedding, QuantLinear
from pdserve.engine.model.weights import install_blocks
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer
from pdserve.kernels.cpu import quant as cpu_quant
from pdserve.kernels.cpu.quant import BlockKind
from tests.helpers.decoder_layer import decode_inputs, per_op, quantized_layer

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")

TYPES = {GGML.Q4_1: BlockKind.Q4_1, GGML.Q8_0: BlockKind.Q8_0}


def interleaved(
    out_features: int, in_features: int, seed: int = 7, ggml_type: GGML = GGML.Q4_1
) -> tuple[BlockKind, torch.Tensor, torch.Tensor]:
    """``(Q4_1_X16 or Q8_0_X16, interleaved blocks, row-major blocks)`` of a random weight, by
    gguf's quantizer."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32) * in_features**-0.5
    plain, blocks = to_kernel_blocks(
        ggml_type, gguf.quants.quantize(weights, ggml_type), out_features, in_features
    )
    kind, x16 = cpu_quant.interleave_rows(plain, blocks, in_features)
    return kind, x16, blocks


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("shape", [(16, 32), (48, 576), (32, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_computes_what_the_reference_does(ggml_type, rows, shape):
    out_features, in_features = shape
    kind, x16, blocks = interleaved(out_features, in_features, ggml_type=ggml_type)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = cpu_quant.quant_matmul(x, kind, x16, in_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    want = cpu_quant.quant_matmul_ref(x.double(), TYPES[ggml_type], blocks, in_features)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2**-8 * float(want.abs().max()))


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
def test_large_activations_keep_their_precision(ggml_type):
    """The decoding adds 128 (and Q8_0 2304) times a block's x sum before taking it back: with
    x far from zero-mean and large, the result must still be the reference's to bf16."""
    kind, x16, blocks = interleaved(32, 576, ggml_type=ggml_type)
    x = (300.0 + torch.rand(4, 576, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    got = cpu_quant.quant_matmul(x, kind, x16, 576).double()
    want = cpu_quant.quant_matmul_ref(x.double(), TYPES[ggml_type], blocks, 576)
    torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-8 * float(want.abs().max()))


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
def test_a_rows_result_is_the_same_in_any_batch(ggml_type):
    kind, x16, _ = interleaved(64, 576, ggml_type=ggml_type)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = cpu_quant.quant_matmul(x, kind, x16, 576)
    for rows in (1, 3, 4, 5, 9):  # tiles of 4 rows of x, and what is left
        assert torch.equal(cpu_quant.quant_matmul(x[-rows:], kind, x16, 576), whole[-rows:]), rows


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
def test_fp32_activations_are_refused(ggml_type):
    kind, x16, _ = interleaved(16, 64, ggml_type=ggml_type)
    with pytest.raises(ValueError, match="bf16"):
        cpu_quant.quant_matmul(torch.randn(1, 64), kind, x16, 64)


@pytest.mark.skipif(
    not cpu_quant.bf16_x16_route(), reason="interleaving bf16 Q4_1 is for CPUs with AVX512-BF16"
)
def test_a_bf16_model_holds_its_projections_and_tied_head_interleaved():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(32, 64)
    model.lm_head = None
    model.proj = torch.nn.Linear(64, 32, bias=False)
    model.odd = torch.nn.Linear(64, 24, bias=False)  # not whole groups of 16: stays row-major
    _, x16, blocks = interleaved(32, 64)
    _, _, odd_blocks = interleaved(48, 64)
    _, table_x16, table = interleaved(32, 64, seed=3, ggml_type=GGML.Q8_0)
    install_blocks(
        model,  # type: ignore[arg-type]
        {
            "proj.weight": (BlockKind.Q4_1, blocks),
            "odd.weight": (BlockKind.Q4_1, odd_blocks[:24].contiguous()),
            "model.embed_tokens.weight": (BlockKind.Q8_0, table),
        },
        torch.bfloat16,
    )
    assert isinstance(model.proj, QuantLinear) and model.proj.kind is BlockKind.Q4_1_X16
    assert torch.equal(model.proj.blocks, x16)
    assert model.odd.kind is BlockKind.Q4_1
    head, embed = model.quant_lm_head, model.model.embed_tokens
    assert isinstance(head, QuantLinear) and isinstance(embed, QuantEmbedding)
    assert head.kind is embed.kind is BlockKind.Q8_0_X16 and torch.equal(head.blocks, table_x16)
    assert head.blocks.data_ptr() == embed.blocks.data_ptr()  # one table, not two
    ids = torch.tensor([0, 5, 17, 31])
    want = cpu_quant.dequantize_ref(BlockKind.Q8_0, table, 64)[ids].to(torch.bfloat16)
    assert torch.equal(embed(ids), want)


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_layer_over_interleaved_weights_is_its_per_op_path(ggml_type, rows):
    layer = quantized_layer(torch.bfloat16, ggml_type, bias=False)
    for owner, name in (
        (layer.self_attn, "qkv_proj"),
        (layer.self_attn, "o_proj"),
        (layer.mlp, "gate_up_proj"),
        (layer.mlp, "down_proj"),
    ):
        proj = getattr(owner, name)
        proj.interleave({})
        assert proj.kind.interleaved
    hidden, cos, sin_signed, cache, meta = decode_inputs(rows, torch.bfloat16)
    reference_cache = cache.clone()
    with torch.inference_mode():
        assert layer.fused() is not None
        assert cpu_decoder_layer.serves(layer.fused(), hidden, cos, cache[:, 1], meta, max_rows=16)
        got = layer(hidden, cos, sin_signed, cache[:, 1], meta)
        want = per_op(layer, hidden, cos, sin_signed, reference_cache[:, 1], meta)
    assert torch.equal(cache, reference_cache)
    assert torch.equal(got, want)
