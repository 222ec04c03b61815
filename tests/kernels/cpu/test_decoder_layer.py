"""The fused decoder layer (``kernels/cpu/csrc/decoder_layer.c``) against the per-op path it replaces.

A decode pass over a layer whose projections are GGUF blocks runs as one C call; the per-op path
(``llama.LlamaDecoderLayer``'s torch code, each op a C call) is the reference. Both must write
the same K and V into the cache and give the same hidden states: bit for bit in bf16 and to an
ulp of SiLU in fp32; a row's result must not depend on the rows batched with it; and every
pass the fused call cannot take (prefill chunks, dense weights) keeps the per-op path.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from pdserve import LLM
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.layers.quant_linear import QuantLinear
from pdserve.engine.model.llama import LlamaDecoderLayer
from pdserve.engine.model.tiny import TINY_SLIDING_WINDOW, write_tiny_model
from pdserve.engine.request import SamplingParams
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import decoder_layer as cpu_decoder_layer
from pdserve.kernels.cpu import quant as cpu_quant
from tests.helpers.decoder_layer import (
    BLOCK_SIZE,
    CONFIG,
    NUM_BLOCKS,
    WIDE_CONFIG,
    decode_inputs,
    per_op,
    quantized_layer,
)

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")


# llama.cpp's Q4_K_M rule for a layer (attn_v and ffn_down Q6_K in about half the layers), with
# gate and up apart; and the fallback of rows that are not whole 256s (Gemma 3 270M, SmolLM2).
MIXES = {
    "q4_k_m": {"q": GGML.Q4_K, "k": GGML.Q4_K, "v": GGML.Q6_K, "o": GGML.Q4_K, "gate": GGML.Q4_K,
               "up": GGML.Q5_K, "down": GGML.Q6_K},
    "q5_0-fallback": {"q": GGML.Q5_0, "k": GGML.Q5_0, "v": GGML.Q8_0, "o": GGML.Q5_0, "gate": GGML.Q4_0,
                      "up": GGML.Q5_1, "down": GGML.Q8_0},
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
def test_the_fused_layer_takes_any_mix_of_kinds_per_projection(dtype, mix, rows, int8_activations):
    """A fused q/k/v or gate/up whose parts differ in kind is held in parts, each as the file
    holds it, and the one C call still computes what the per-op path does."""
    layer = quantized_layer(dtype, MIXES[mix], False, int8_activations=int8_activations, config=WIDE_CONFIG)
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert [kind.plain.name for kind, _ in qkv.parts] == [MIXES[mix]["q"].name, MIXES[mix]["v"].name]
    assert len(gate_up.parts) == 2
    hidden, cos, sin_signed, cache, meta = decode_inputs(rows, dtype, config=WIDE_CONFIG)
    reference_cache = cache.clone()
    with torch.inference_mode():
        assert layer.fused() is not None
        assert layer.fused().args.qkv.parts == 2 and layer.fused().args.o.parts == 1
        got = layer(hidden, cos, sin_signed, cache[:, 1], meta)
        want = per_op(layer, hidden, cos, sin_signed, reference_cache[:, 1], meta)
    assert torch.isfinite(got).all()
    assert torch.equal(cache, reference_cache)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_projection_in_parts_is_the_matmul_of_its_stacked_weights():
    """Per op, each part is its own kernel call and the outputs sit side by side; a prefill chunk
    decodes every part into one weight for the GEMM: both are x @ W^T of the whole weight."""
    layer = quantized_layer(torch.float32, MIXES["q4_k_m"], False, config=WIDE_CONFIG)
    qkv = layer.self_attn.qkv_proj
    weight = torch.cat(
        [cpu_quant.dequantize_ref(kind, blocks, qkv.in_features) for kind, blocks in qkv.parts]
    )
    assert weight.shape == (qkv.out_features, qkv.in_features) == (256 + 2 * 64, 256)
    assert qkv.describe() == "Q4_K+Q6_K"
    for rows in (2, 40):  # the kernels, and decode-then-GEMM
        x = torch.randn(rows, qkv.in_features, generator=torch.Generator().manual_seed(rows))
        expected = x.double() @ weight.double().T
        got = qkv(x)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
def test_the_fused_layer_computes_what_the_per_op_path_does(dtype, ggml_type, rows, bias, int8_activations):
    layer = quantized_layer(dtype, ggml_type, bias, int8_activations=int8_activations)
    hidden, cos, sin_signed, cache, meta = decode_inputs(rows, dtype)
    reference_cache = cache.clone()
    with torch.inference_mode():
        assert layer.fused() is not None
        assert layer.fused().args.int8_activations == int8_activations
        assert cpu_decoder_layer.serves(layer.fused(), hidden, cos, cache[:, 1], meta, max_rows=16)
        got = layer(hidden, cos, sin_signed, cache[:, 1], meta)
        want = per_op(layer, hidden, cos, sin_signed, reference_cache[:, 1], meta)
    assert torch.equal(cache, reference_cache)  # the same K and V in the same slots, nothing else
    assert not torch.equal(hidden, got)  # the input is left as it was, the output is new
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # SiLU's exp is the C library's here and torch's vectorised one there
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
@pytest.mark.parametrize("runs", [[(0, 2)], [(0, 1), (1, 2)]], ids=["one-call", "call-a-layer"])
def test_a_fused_pass_runs_layers_as_one_call_each_over_its_own_cache_layer(dtype, int8_activations, runs):
    """``FusedPass.run`` over both layers of the cache (in one call, or a call a layer as the
    engine's input polls split a pass): the same hidden states and K/V as the layers one by one,
    each layer writing only its own part of the cache."""
    layers = [
        quantized_layer(dtype, GGML.Q4_1, bias=False, seed=seed, int8_activations=int8_activations)
        for seed in (3, 4)
    ]
    hidden, cos, sin_signed, cache, meta = decode_inputs(3, dtype)
    reference_cache = cache.clone()
    with torch.inference_mode():
        prepared = cpu_decoder_layer.PreparedLayers([layer.fused() for layer in layers])
        fused = cpu_decoder_layer.FusedPass(prepared, cos, sin_signed, cache, meta)
        got = hidden
        for first, last in runs:
            got = fused.run(first, last, got)
        want = hidden
        for index, layer in enumerate(layers):
            want = cpu_decoder_layer.decoder_layer(
                layer.fused(), want, cos, sin_signed, reference_cache[:, index], meta
            )
    assert torch.equal(got, want)
    assert torch.equal(cache, reference_cache)
    assert not torch.equal(cache[:, 0], decode_inputs(3, dtype)[3][:, 0])  # both layers wrote their K/V
    assert not torch.equal(cache[:, 1], decode_inputs(3, dtype)[3][:, 1])
    with pytest.raises(ValueError, match="layers 1..3 of 2"):
        fused.run(1, 3, hidden)


def test_layers_of_different_shapes_do_not_fuse_into_one_run():
    wide = ModelArchConfig(**{**CONFIG.to_dict(), "intermediate_size": 512})
    narrow_layer = quantized_layer(torch.float32, GGML.Q4_1, bias=False)
    wide_layer = LlamaDecoderLayer(wide)
    for owner, name in ((wide_layer.self_attn, "qkv_proj"), (wide_layer.self_attn, "o_proj"),
                        (wide_layer.mlp, "gate_up_proj"), (wide_layer.mlp, "down_proj")):  # fmt: skip
        dense = getattr(owner, name)
        out_features, in_features = dense.weight.shape
        raw = gguf.quants.quantize(np.zeros((out_features, in_features), np.float32), GGML.Q8_0)
        setattr(
            owner,
            name,
            QuantLinear(*to_kernel_blocks(GGML.Q8_0, raw, out_features, in_features), in_features),
        )
    with pytest.raises(ValueError, match="share their shapes"):
        cpu_decoder_layer.PreparedLayers([narrow_layer.fused(), wide_layer.fused()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
def test_a_rows_result_does_not_depend_on_its_batch(dtype, int8_activations):
    layer = quantized_layer(dtype, GGML.Q4_1, bias=False, int8_activations=int8_activations)
    hidden, cos, sin_signed, cache, meta = decode_inputs(5, dtype)
    with torch.inference_mode():
        together = layer(hidden, cos, sin_signed, cache.clone()[:, 1], meta)
        for i in range(5):
            alone_meta = AttentionMetadata(
                slot_mapping=meta.slot_mapping[i : i + 1],
                num_decode_tokens=1,
                decode_block_tables=meta.decode_block_tables[i : i + 1],
                decode_seq_lens=meta.decode_seq_lens[i : i + 1],
                prefill_block_tables=meta.prefill_block_tables,
                prefill_query_start_loc=meta.prefill_query_start_loc,
                prefill_seq_lens=meta.prefill_seq_lens,
            )
            alone = layer(
                hidden[i : i + 1], cos[i : i + 1], sin_signed[i : i + 1], cache.clone()[:, 1], alone_meta
            )
            assert torch.equal(alone[0], together[i])


def test_passes_the_fused_layer_cannot_take_keep_the_per_op_path():
    layer = quantized_layer(torch.float32, GGML.Q4_1, bias=False)
    hidden, cos, _, cache, meta = decode_inputs(2, torch.float32)
    fused = layer.fused()
    assert fused is not None
    prefill_meta = AttentionMetadata(
        **{**meta.__dict__, "num_decode_tokens": 1}
    )  # one decode, one chunk token
    assert not cpu_decoder_layer.serves(fused, hidden, cos, cache[:, 1], prefill_meta, max_rows=16)
    assert not cpu_decoder_layer.serves(fused, hidden, cos, cache[:, 1], meta, max_rows=1)  # too many rows
    assert not cpu_decoder_layer.serves(fused, hidden.bfloat16(), cos, cache[:, 1], meta, max_rows=16)
    dense = LlamaDecoderLayer(CONFIG)  # nn.Linear projections: nothing for the C kernel to read
    assert dense.fused() is None
    mixed = quantized_layer(torch.float32, GGML.Q4_1, bias=False)
    mixed.mlp.down_proj.int8_activations = True  # one projection's x in int8, the others' not
    assert mixed.fused() is None


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-mistral")), seed=0, variant="mistral")


@pytest.mark.parametrize(
    "quantization, model",
    [("int8", "llama"), ("int8-a8", "llama"), ("int8", "mistral")],
    ids=["int8", "int8-a8", "int8-mistral"],
)
def test_serving_int8_weights_gives_the_per_op_paths_tokens(
    tiny_model_dir, tiny_mistral_dir, monkeypatch, quantization, model
):
    """End to end: greedy tokens of an int8 engine (decodes of one and of three sequences) are
    the same with the fused layer and without it, with activations in fp32 or in int8; for
    Mistral, whose every layer attends through its window, past the window too."""
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 12, 10, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    if model == "mistral":
        tiny_model_dir = tiny_mistral_dir
        prompts[2] = [(7 * i) % 50 + 3 for i in range(TINY_SLIDING_WINDOW + 5)]
        params = SamplingParams(max_tokens=TINY_SLIDING_WINDOW, ignore_eos=True)

    layer_counts = []

    def tokens() -> list[list[int]]:
        llm = LLM(tiny_model_dir, quantization=quantization, num_blocks=64)
        layer_counts.append(llm.engine.runner.num_layers)
        return [out.token_ids for out in llm.generate(prompts, params)] + [
            llm.generate([prompts[0]], params)[0].token_ids
        ]

    calls = []
    real = cpu_decoder_layer.FusedPass.run
    monkeypatch.setattr(
        cpu_decoder_layer.FusedPass, "run", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k)
    )
    fused_tokens = tokens()
    assert calls, "the int8 engine's decode steps never took the fused layers"
    assert set(calls) == {(0, layer_counts[0])}, "without a poll hook, a step's layers are one call"
    monkeypatch.setattr(cpu_decoder_layer, "serves", lambda *a, **k: False)
    assert fused_tokens == tokens()


# decode_inputs' contexts are 5, 28, 51 (block size 16): windows of 1, mid-block, starting on a
# block boundary for the 28-token context (12) and the 51-token one (35), and beyond them all.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 7, 12, 35, 1000])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["dtype-x", "int8-x"])
def test_the_fused_layer_with_a_window_computes_what_the_per_op_path_does(dtype, window, int8_activations):
    """As the test without a window: the same K/V, the same bits in bf16; and the window takes
    (a row whose context it cuts short differs from full attention's, another does not). The
    window is the layer's own (Mistral's config), which the fused call takes from it."""
    layer = quantized_layer(
        dtype, GGML.Q8_0, bias=False, int8_activations=int8_activations, sliding_window=window
    )
    unwindowed = quantized_layer(dtype, GGML.Q8_0, bias=False, int8_activations=int8_activations)
    hidden, cos, sin_signed, cache, meta = decode_inputs(3, dtype)
    reference_cache = cache.clone()
    with torch.inference_mode():
        full = per_op(unwindowed, hidden, cos, sin_signed, cache.clone()[:, 1], meta)
        assert layer.fused() is not None and layer.fused().args.sliding_window == window
        got = layer(hidden, cos, sin_signed, cache[:, 1], meta)
        want = per_op(layer, hidden, cos, sin_signed, reference_cache[:, 1], meta)
    assert torch.equal(cache, reference_cache)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # SiLU's exp, as without a window
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for row, length in enumerate(meta.decode_seq_lens.tolist()):
        assert torch.equal(want[row], full[row]) == (length <= window), (row, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layers_of_one_run_attend_through_their_own_windows(dtype):
    """Gemma 3's pattern: local layers (a window) and a global one (none) in one ``FusedPass``
    call give what each layer gives alone with its own window."""
    windows = [7, 0, 20]
    layers = [quantized_layer(dtype, GGML.Q4_1, bias=False, seed=seed) for seed in (3, 4, 5)]
    hidden, cos, sin_signed, _, meta = decode_inputs(3, dtype)
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(
        NUM_BLOCKS, len(layers), 2, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen
    )
    cache = cache.to(dtype)
    reference_cache = cache.clone()
    with torch.inference_mode():
        prepared = [
            cpu_decoder_layer.PreparedLayer(**{**_prepared_kwargs(layer), "sliding_window": window})
            for layer, window in zip(layers, windows, strict=True)
        ]
        fused = cpu_decoder_layer.FusedPass(
            cpu_decoder_layer.PreparedLayers(prepared), cos, sin_signed, cache, meta
        )
        got = fused.run(0, len(layers), hidden)
        want = hidden
        for index, layer in enumerate(prepared):
            want = cpu_decoder_layer.decoder_layer(
                layer, want, cos, sin_signed, reference_cache[:, index], meta
            )
        unwindowed = hidden
        for index, layer in enumerate(layers):
            unwindowed = cpu_decoder_layer.decoder_layer(
                layer.fused(), unwindowed, cos, sin_signed, reference_cache.clone()[:, index], meta
            )
    assert torch.equal(got, want)
    assert torch.equal(cache, reference_cache)
    assert [layer.args.sliding_window for layer in prepared] == windows
    assert not torch.equal(got[1:], unwindowed[1:])  # contexts 28 and 51 are cut short


def _prepared_kwargs(layer: LlamaDecoderLayer) -> dict:
    """The arguments ``LlamaDecoderLayer.fused`` prepared ``layer`` with."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = {
        name: cpu_decoder_layer.BlockWeight(tuple(proj.parts))
        for name, proj in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                           ("down", mlp.down_proj))
    }  # fmt: skip
    return dict(
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        intermediate=mlp.intermediate_size,
        eps=layer.input_layernorm.eps,
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv_bias=attn.qkv_proj.bias,
        int8_activations=attn.qkv_proj.int8_activations,
        **weights,
    )
