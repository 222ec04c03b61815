"""The fused decoder layer (``kernels/cpu/decoder_layer.c``) against the per-op path it replaces.

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
from pdserve.engine.model.attention import AttentionMetadata
from pdserve.engine.model.gguf_blocks import to_kernel_blocks
from pdserve.engine.model.llama import LlamaDecoderLayer
from pdserve.engine.model.quant_linear import QuantLinear, use_int8_activations
from pdserve.engine.request import SamplingParams
from pdserve.kernels import cpu_build, cpu_decoder_layer

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")

BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS = 16, 24, 2
CONFIG = ModelArchConfig(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_layers=NUM_LAYERS,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def quantized_layer(
    dtype: torch.dtype, ggml_type: GGML, bias: bool, seed: int = 0, int8_activations: bool = False
) -> LlamaDecoderLayer:
    """A decoder layer of CONFIG with random weights, its projections held as ``ggml_type`` blocks
    (quantizing their activations to int8 with ``int8_activations``: ``--quantization gguf-a8``)."""
    config = ModelArchConfig(**{**CONFIG.to_dict(), "attention_bias": bias})
    gen = torch.Generator().manual_seed(seed)
    layer = LlamaDecoderLayer(config)
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=gen))
    layer = layer.to(dtype)
    attn, mlp = layer.self_attn, layer.mlp
    for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
        dense = getattr(owner, name)
        out_features, in_features = dense.weight.shape
        weights = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).numpy()
        raw = gguf.quants.quantize(weights.astype(np.float32), ggml_type)
        kind, blocks = to_kernel_blocks(ggml_type, raw, out_features, in_features)
        b = None if dense.bias is None else (0.1 * torch.randn(out_features, generator=gen)).to(dtype)
        setattr(owner, name, QuantLinear(kind, blocks, in_features, b))
    if int8_activations:
        use_int8_activations(layer)
    return layer.eval()


def decode_inputs(rows: int, dtype: torch.dtype, seed: int = 1):
    """``(hidden, cos, sin_signed, cache, meta)`` for ``rows`` decode tokens of sequences with
    contexts of different lengths over a two-layer cache (the layer's view steps over the
    other layer, as the engine's does), whose earlier positions hold random K/V."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = CONFIG.num_kv_heads, CONFIG.head_dim
    cache = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [5 + 23 * i for i in range(rows)]  # context incl. the new token: 5, 28, 51, ...
    tables, slots = [], []
    next_block = 0
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // BLOCK_SIZE)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (width - len(blocks)))
        slots.append(blocks[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    positions = torch.tensor([n - 1 for n in lens])
    inv_freq = 1.0 / (CONFIG.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype).unsqueeze(1)
    sin_signed = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype).unsqueeze(1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=rows,
        decode_block_tables=torch.tensor(tables, dtype=torch.int32),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
    )
    hidden = torch.randn(rows, CONFIG.hidden_size, generator=gen).to(dtype)
    return hidden, cos, sin_signed, cache, meta


def per_op(layer: LlamaDecoderLayer, *args) -> torch.Tensor:
    """The layer run op by op, as without the fused kernel."""
    fused, asked = layer._fused, layer._fused_asked
    layer._fused, layer._fused_asked = None, True
    try:
        return layer(*args)
    finally:
        layer._fused, layer._fused_asked = fused, asked


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


@pytest.mark.parametrize("quantization", ["int8", "int8-a8"])
def test_serving_int8_weights_gives_the_per_op_paths_tokens(tiny_model_dir, monkeypatch, quantization):
    """End to end: greedy tokens of an int8 engine (decodes of one and of three sequences) are
    the same with the fused layer and without it, with activations in fp32 or in int8."""
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 12, 10, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

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
