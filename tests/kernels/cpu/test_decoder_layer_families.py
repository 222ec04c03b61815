"""The fused decoder layer (``kernels/cpu/csrc/decoder_layer.c``) for Qwen3's and Gemma 3's layers.

Qwen3 adds a qk-norm to Llama's layer; Gemma 3 a qk-norm, norms after attention and after the
MLP, ``1 + w`` norms in float32, GeGLU, its own attention scale, and per layer a RoPE base and
a window (sliding layers rotate by the local table). A decode pass over such a layer runs as one
C call as Llama's does, and must compute what the per-op path does: the same K and V in the
cache, and the same hidden states (bit for bit in bf16, to fp32 roundings in fp32).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gemma3 import LOCAL_ROPE, Gemma3DecoderLayer
from pdserve.engine.model.qwen3 import Qwen3DecoderLayer
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer
from tests.helpers.decoder_layer import CONFIG, decode_inputs, per_op, quantized_layer

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")

GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
# Layer 0 slides over the last 8 keys and rotates by the local base, layer 1 attends to all.
GEMMA_CONFIG = ModelArchConfig(
    **{
        **CONFIG.to_dict(),
        "family": "gemma3",
        "rope_theta": GLOBAL_THETA,
        "rope_local_theta": LOCAL_THETA,
        "sliding_window": 8,
        "sliding_layers": (True, False),
        "query_pre_attn_scalar": 24.0,
    }
)
QWEN3_CONFIG = ModelArchConfig(**{**CONFIG.to_dict(), "family": "qwen3"})
FAMILIES = {
    "qwen3": (Qwen3DecoderLayer, QWEN3_CONFIG, (CONFIG.rope_theta,)),
    "gemma3": (Gemma3DecoderLayer, GEMMA_CONFIG, (GLOBAL_THETA, LOCAL_THETA)),
}


def _layer(family: str, dtype: torch.dtype, ggml_type: GGML, int8_activations: bool, layer_index: int):
    layer_class, config, _ = FAMILIES[family]
    return quantized_layer(
        dtype,
        ggml_type,
        False,
        int8_activations=int8_activations,
        config=config,
        layer_class=layer_class,
        layer_index=layer_index,
    )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ggml_type", [GGML.Q8_0, GGML.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
@pytest.mark.parametrize("layer_index", [0, 1], ids=["layer-0", "layer-1"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_layer_computes_what_the_per_op_path_does(
    family, dtype, ggml_type, int8_activations, layer_index, rows
):
    if ggml_type is GGML.Q5_0 and not int8_activations and dtype == torch.bfloat16 and family == "qwen3":
        pytest.skip("one Q5_0 float-activation case per family is enough")  # keeps the matrix small
    layer = _layer(family, dtype, ggml_type, int8_activations, layer_index)
    thetas = FAMILIES[family][2]
    hidden, cos, sin_signed, cache, meta = decode_inputs(
        rows, dtype, config=FAMILIES[family][1], thetas=thetas
    )
    reference_cache = cache.clone()
    with torch.inference_mode():
        fused = layer.fused()
        assert fused is not None
        assert cpu_decoder_layer.serves(fused, hidden, cos, cache[:, 1], meta, max_rows=16)
        got = layer(hidden, cos, sin_signed, cache[:, 1], meta)
        want = per_op(layer, hidden, cos, sin_signed, reference_cache[:, 1], meta)
    assert torch.isfinite(got).all()
    assert torch.equal(cache, reference_cache)  # the same K and V in the same slots
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # fp32 norms' sums of squares in torch's order where a per-op norm is torch's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemma_layers_carry_their_own_rope_table_window_scale_and_norm_form():
    sliding = _layer("gemma3", torch.bfloat16, GGML.Q8_0, True, 0).fused()
    full = _layer("gemma3", torch.bfloat16, GGML.Q8_0, True, 1).fused()
    assert sliding is not None and full is not None
    assert (sliding.args.rope_table, sliding.args.sliding_window) == (LOCAL_ROPE, 8)
    assert (full.args.rope_table, full.args.sliding_window) == (0, 0)
    assert sliding.args.scale == pytest.approx(24.0**-0.5)
    assert (
        sliding.args.norm_weight_f32 == 1
        and sliding.args.activation == cpu_decoder_layer.ACTIVATIONS["gelu_tanh"]
    )
    assert sliding.args.post_attention_norm and sliding.args.post_feedforward_norm and sliding.args.q_norm
    assert sliding.dtype == torch.bfloat16


def test_a_pass_over_sliding_and_global_layers_is_one_call_with_each_layers_table():
    """Gemma 3's layers of one run differ in RoPE table and window: one C call over both must
    give what the two layers give op by op, each over its own cache layer."""
    dtype = torch.bfloat16
    layers = [_layer("gemma3", dtype, GGML.Q8_0, True, i) for i in range(2)]
    hidden, cos, sin_signed, cache, meta = decode_inputs(
        3, dtype, config=GEMMA_CONFIG, thetas=FAMILIES["gemma3"][2]
    )
    reference_cache = cache.clone()
    with torch.inference_mode():
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused() for layer in layers])
        got = cpu_decoder_layer.FusedPass(prepared, cos, sin_signed, cache, meta).run(0, 2, hidden)
        want = hidden
        for i, layer in enumerate(layers):
            want = per_op(layer, want, cos, sin_signed, reference_cache[:, i], meta)
    assert torch.equal(cache, reference_cache)
    assert torch.equal(got, want)


def test_norms_in_another_dtype_than_float32_or_the_activations_are_refused():
    layer = _layer("gemma3", torch.bfloat16, GGML.Q8_0, False, 0)
    weight = torch.ones(CONFIG.hidden_size, dtype=torch.float16)
    blocks = {
        name: cpu_decoder_layer.BlockWeight(tuple(projection.parts))
        for name, projection in (
            ("qkv", layer.self_attn.qkv_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj),
        )
    }
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 32, "intermediate": 256, "eps": 1e-6}
    with pytest.raises(ValueError, match="norms"):
        cpu_decoder_layer.PreparedLayer(
            **shape, **blocks, input_norm=weight, post_norm=weight, dtype=torch.bfloat16
        )
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        cpu_decoder_layer.PreparedLayer(
            **shape, **blocks, input_norm=weight.float(), post_norm=weight.float(), q_norm=weight.float()
        )
