"""The C layer ops (``kernels/cpu/csrc/layer_ops.c``) against the torch ops they replace in the model.

RoPE, the KV write and bf16 RMSNorm must be bit-identical to the torch path (``rotary.apply_rope``,
``reference.reshape_and_cache_ref``, ``norm.RMSNorm``'s torch branch); fp32 RMSNorm may differ by
a rounding of its scale (another order of the sum of squares); so may Gemma's (``1 + w`` in fp32, one
rounding). SiLU x up and GELU(tanh) x up use their own exp, within a few fp32 ulps of torch's. The model falls back to torch where the library cannot be had or a
backend is forced.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from pdserve.engine.model.layers.rotary import apply_rope
from pdserve.kernels import reference
from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import layer_ops as cpu_layer_ops

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler here")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _torch_norm(norm: RMSNorm, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setenv("PDSERVE_KERNELS", "torch")
        return norm(x)


@DTYPES
@pytest.mark.parametrize("hidden", [576, 64, 13])
def test_rms_norm_and_the_residual_add_match_torch(dtype, hidden, monkeypatch):
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm = norm.to(dtype)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(5, hidden, generator=gen).to(dtype)
    with torch.inference_mode():
        want_sum = x + delta
        want = _torch_norm(norm, want_sum, monkeypatch)
        assert cpu_layer_ops.serves(x)
        summed, got = norm.add_and_norm(x, delta)
        alone = norm(want_sum)
    assert torch.equal(summed, want_sum)  # the add rounds as torch's
    assert torch.equal(got, alone)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # the sum of squares in another order: the scale may move by a rounding
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@DTYPES
def test_rope_and_the_kv_write_match_torch_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, block_size = 6, 9, 3, 64, 16
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 17, 255, 1000, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(dtype).unsqueeze(1)
    sin_signed = torch.cat((-freqs.sin(), freqs.sin()), -1).to(dtype).unsqueeze(1)
    cache = torch.randn(12, 4, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)  # 4 layers
    slots = torch.tensor([3, 16, -1, 40, 191, 100])  # -1: padding, not written
    with torch.inference_mode():
        rotated = apply_rope(qkv[:, : heads + kv_heads], cos, sin_signed)
        want_cache = cache.clone()
        reference.reshape_and_cache_ref(
            rotated[:, heads:], qkv[:, heads + kv_heads :], want_cache[:, 2], slots
        )
        got = qkv.clone()
        cpu_layer_ops.rope_and_cache(got, heads, cos, sin_signed, cache[:, 2], slots)
    assert torch.equal(got[:, : heads + kv_heads], rotated)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v as it was
    assert torch.equal(cache, want_cache)  # layer 2's slots written, everything else untouched


@DTYPES
@pytest.mark.parametrize("inter", [1536, 40, 7])  # whole vectors; a partial last one; less than one
def test_silu_times_up_matches_torch(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -100.0])  # zero, exp's clamp on both sides
    got = cpu_layer_ops.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert got.dtype == dtype and got.shape == (5, inter)
    if dtype == torch.bfloat16:  # each SiLU rounded to bf16 before the product, as torch does
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-30)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    assert got[0, 2] == gate_up[0, inter + 2] * 90.0  # silu(90) is 90 in fp32
    # the C pass reads only its own row: a row alone gives what it gives among others
    assert torch.equal(cpu_layer_ops.silu_mul(gate_up[3:4]), got[3:4])


@DTYPES
@pytest.mark.parametrize("hidden", [640, 256, 13])
def test_gemmas_norm_scales_by_one_plus_w_in_fp32_and_rounds_once(dtype, hidden, monkeypatch):
    """Gemma 3's norm (``GemmaRMSNorm``): the fp32 weight ``1 + w`` multiplies the unrounded normed
    value, rounded once to the dtype (Llama's rounds the normed value first)."""
    gen = torch.Generator().manual_seed(hidden)
    norm = GemmaRMSNorm(hidden, 1e-6)
    norm.weight.data = 0.5 * torch.randn(hidden, generator=gen)
    norm = norm.to(dtype)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(5, hidden, generator=gen).to(dtype)
    with torch.inference_mode():
        want_sum = x + delta
        want = _torch_norm(norm, want_sum, monkeypatch)  # F.rms_norm in fp32, then rounded
        summed, got = norm.add_and_norm(x, delta)
        alone = norm(want_sum)
    assert torch.equal(summed, want_sum)
    assert torch.equal(got, alone)
    if dtype == torch.bfloat16:  # the sum of squares' order may move a value by a rounding, rarely
        assert (got != want).float().mean() < 1e-2
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-30)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    llama_form = cpu_layer_ops.rms_norm(want_sum, norm.scale().to(dtype), 1e-6)[1]
    if dtype == torch.bfloat16:  # two roundings, not one: not the same numbers
        assert not torch.equal(llama_form, got)


@DTYPES
@pytest.mark.parametrize("inter", [2048, 40, 7])
def test_gelu_tanh_times_up_matches_torch(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 60.0, -60.0])  # zero, tanh's saturation on both sides
    got = cpu_layer_ops.gelu_tanh_mul(gate_up)
    gelu = torch.nn.functional.gelu(gate_up[:, :inter], approximate="tanh")
    want = gelu * gate_up[:, inter:]
    assert got.dtype == dtype and got.shape == (5, inter)
    body = gate_up[:, :inter].float() > -3  # below, 1 + tanh is 1 minus nearly 1 (cancels) in both
    if dtype == torch.bfloat16:  # each GELU rounded to bf16 before the product, as torch does
        assert torch.equal(got[body], want[body])
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2 * float(want.abs().max()))
    else:  # tanh through exp: within a few fp32 roundings where nothing cancels
        torch.testing.assert_close(got[body], want[body], rtol=4e-6, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6 * float(want.abs().max()))
    assert got[0, 2] == gate_up[0, inter + 2] * 60.0 and got[0, 3] == 0  # gelu(60) = 60, gelu(-60) = -0
    assert torch.equal(cpu_layer_ops.gelu_tanh_mul(gate_up[3:4]), got[3:4])


def test_the_mlp_runs_silu_times_up_in_c_where_it_can(monkeypatch):
    from pdserve.engine.model.llama import LlamaMLP
    from tests.helpers.decoder_layer import CONFIG

    calls = []
    real = cpu_layer_ops.silu_mul
    monkeypatch.setattr(
        cpu_layer_ops, "silu_mul", lambda gate_up: calls.append(gate_up.shape) or real(gate_up)
    )
    mlp = LlamaMLP(CONFIG)
    x = torch.randn(3, CONFIG.hidden_size)
    with torch.inference_mode():
        got = mlp(x)
        monkeypatch.setenv("PDSERVE_KERNELS", "torch")
        want = mlp(x)
    assert calls == [(3, 2 * CONFIG.intermediate_size)]  # once, and not with the torch backend forced
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shapes_that_do_not_fit_are_refused():
    qkv = torch.randn(2, 15, 64)
    cache_layer = torch.zeros(4, 3, 2, 16, 3, 64)[:, 0]
    cos = torch.ones(2, 1, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_layer_ops.rope_and_cache(qkv, 8, cos, cos, cache_layer, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_layer_ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="not gate \\+ up"):
        cpu_layer_ops.silu_mul(torch.randn(2, 7))


def test_the_torch_ops_run_where_the_c_ones_cannot(monkeypatch):
    x = torch.randn(3, 64)
    assert cpu_layer_ops.serves(x)
    assert not cpu_layer_ops.serves(x.t())  # not contiguous
    assert not cpu_layer_ops.serves(x.half())
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PDSERVE_KERNELS", backend)
        assert not cpu_layer_ops.serves(x)
    monkeypatch.delenv("PDSERVE_KERNELS")
    monkeypatch.setattr(cpu_layer_ops.KERNELS, "_library", None)
    monkeypatch.setattr(cpu_layer_ops.KERNELS, "_load_error", "no C compiler (cc, gcc or clang) on PATH")
    assert not cpu_layer_ops.serves(x)
    norm = RMSNorm(64, 1e-5)
    with torch.inference_mode():
        summed, normed = norm.add_and_norm(x, x)
        assert torch.equal(normed, torch.nn.functional.rms_norm(x + x, (64,), norm.weight, 1e-5))
