"""Quantized weights against fp32: perplexity on the fixed text and greedy agreement on the
fixed prompts (the same data, window and bounds' reasoning as ``test_quality_bf16``).

Measured on an AMD EPYC with avx512_bf16 (torch 2.13; window 1024 over the 3,926 scored tokens
of ``data/quality_text.txt``), bundled SmolLM2-135M (a Q4_1 file with a Q8_0 embedding):

| setting | perplexity | vs fp32 dense |
|---|---|---|
| fp32, dense (the file dequantized) | 21.9150 | |
| fp32, ``gguf`` (the file's blocks) | 21.9150 | 0.000% |
| bf16, ``gguf`` | 21.9232 | +0.037% (bf16 dense: the same) |
| fp32, ``int8`` (Q8_0 of the dequantized file) | 21.9179 | +0.013% |
| bf16, ``int8`` | 21.9116 | -0.016% |

``gguf-a8`` (the same blocks, x quantized to int8 per 32 in the kernels) measured on the
2-core AMD EPYC (Zen 3, AVX2, no AVX-512) here, its perplexity in chunks of 16 tokens so that
every projection runs the kernel: 22.0002 against fp32 dense 21.9148, +0.39%. On the Zen 5
(AVX512-VNNI: interleaved weights, whose kernel runs prefill chunks too): fp32 in chunks of 16
22.0225 (+0.49%), in whole windows 21.9870 (+0.33%); bf16 in whole windows 21.9418 (+0.12%).
Since SiLU x up runs in C on every path (``layer_ops.c``'s exp, not torch's), the Zen 5 gives:
bf16 ``gguf`` and bf16 dense 21.9045 (-0.048%), bf16 ``int8`` 21.8857 (-0.134%), fp32 ``gguf``
and ``int8`` unchanged, fp32 ``gguf-a8`` in chunks of 16 22.0164 (+0.46%).

``gguf`` holds the same numbers as the dense model made from the same file, so its perplexity in
fp32 is the dense one's to the last digit (prefill chunks decode the blocks and run the dense
GEMM); in bf16 it is bf16's rounding, +-0.07% (see ``test_quality_bf16``). The bounds are the
issue's: ``gguf`` within 0.5% of the fp32 dequantization of the same file, ``int8`` within 1% of
fp32; ``gguf-a8`` is held to ``gguf``'s 0.5%. Greedy completions go through the decode kernel
(batches of up to 16 rows), where a whole-window perplexity does not; they must track fp32 as
closely as bf16's are required to.
"""

from __future__ import annotations

import pytest

from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS
from pdserve.kernels.cpu import quant as cpu_quant
from tests.helpers import quality
from tests.helpers.bundled_quality import (
    MIN_FRACTION_FIRST_4,
    MIN_MEAN_FIRST_DIVERGENCE,
    measure_quality,
    needs_native_bf16,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler to build the kernels"),
]

# |ppl / ppl_fp32_dense - 1|: the file's blocks, with int8 activations too, are held to the
# issue's bound for the file's own numbers.
MAX_PPL_CHANGE = {"gguf": 0.005, "int8": 0.01, "gguf-a8": 0.005}
SETTINGS = [
    ("float32", "gguf"),
    pytest.param("bfloat16", "gguf", marks=needs_native_bf16),
    ("float32", "int8"),
    ("float32", "gguf-a8"),
]
SETTING_IDS = ["float32/gguf", "bfloat16/gguf", "float32/int8", "float32/gguf-a8"]


def perplexity_chunk(quantization: str) -> int | None:
    """The "-a8" modes quantize activations in the decode kernels only, which a whole-window
    prefill does not run: their perplexity is taken in chunks the kernels take, as decode
    steps would run them (``quality.perplexity``'s ``chunk``)."""
    return KERNEL_MAX_ROWS if quantization.endswith("-a8") else None


@pytest.mark.parametrize(("dtype", "quantization"), SETTINGS, ids=SETTING_IDS)
def test_quantized_perplexity_within_budget_of_fp32(dtype, quantization):
    reference, _ = measure_quality("float32", "none")
    candidate, _ = measure_quality(dtype, quantization, perplexity_chunk(quantization))
    change = candidate.increase_over(reference)
    assert abs(change) <= MAX_PPL_CHANGE[quantization], (
        f"{dtype}/{quantization} perplexity {candidate.ppl:.4f} vs fp32 {reference.ppl:.4f}: {change:+.3%}"
    )
    if (dtype, quantization) == ("float32", "gguf"):
        assert change == 0.0  # the file's own numbers, and prefill runs the same GEMM on them


@pytest.mark.parametrize(("dtype", "quantization"), SETTINGS, ids=SETTING_IDS)
def test_quantized_greedy_completions_track_fp32(dtype, quantization):
    _, reference = measure_quality("float32", "none")
    _, candidate = measure_quality(dtype, quantization, perplexity_chunk(quantization))
    agreement = quality.greedy_agreement(reference, candidate)
    detail = f"matched prefixes {agreement.matched_prefix} of {agreement.reference_lengths}"
    assert agreement.mean_first_divergence >= MIN_MEAN_FIRST_DIVERGENCE, detail
    assert agreement.fraction_matching_first(4) >= MIN_FRACTION_FIRST_4, detail
