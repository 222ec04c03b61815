"""bf16 weights against float32: perplexity on a fixed text and greedy agreement on fixed prompts.

The two slow tests load the bundled SmolLM2-135M twice (float32, bfloat16) through ``pdserve.LLM``
and share one measurement. Thresholds, from measurements on an AMD EPYC with avx512_bf16
(torch 2.13, 2 threads; window 1024 over the 3,926 scored tokens of ``data/quality_text.txt``):

- Perplexity fp32 21.915, bf16 21.923: +0.037%. The per-token NLL differences have a standard
  deviation of 0.042 nats, so the mean over 3,926 tokens is known to about +-0.07% (1 sigma),
  and over six settings (windows 512, 768, 1000, 1024, 2048; 1024 with stride 512) it ranged from
  -0.076% to +0.037%: bf16 (weights, activations, KV cache) is indistinguishable from fp32 here.
  The bound ``MAX_BF16_PPL_CHANGE`` (0.3%, either way) is about 4 sigma of that rounding noise,
  so another CPU's bf16 kernels (other rounding) still pass, yet it fails a real loss: rounding
  the bf16 weights to 4 of their 7 mantissa bits raised perplexity 0.55% (5: 0.15%, 3: 4.1%).
- Greedy, 32 new tokens per prompt over the 20 prompts of ``data/quality_prompts.json``: mean
  first divergence 18.2 tokens (fp32 against itself: 28.5, the mean completion length, as some
  stop at EOS), first 4 tokens equal for 85% of prompts, 45% fully identical; run one prompt at
  a time (other GEMM shapes, other bf16 rounding): 17.9, 80%, 45%. fp32 alone, batched, on 1 or
  2 threads gave identical tokens. Divergence is from near-ties, not damage: the one prompt
  that differs at its first token has a top-2 logit margin of 0.018 in fp32, while bf16 moves
  logits by up to ~0.5. Hence the bounds: a mean first divergence of at least
  ``MIN_MEAN_FIRST_DIVERGENCE`` (12) tokens and the first 4 tokens equal for at least
  ``MIN_FRACTION_FIRST_4`` (65%) of prompts: room for 3-4 more prompts to lose an early near-tie
  than measured. This is a smoke check, not a fine one: two decoder layers swapped (a loader
  bug) gives 3.8 and 40% and fails, but weights rounded to 1 mantissa bit (perplexity +75%)
  still give 13.2 and 70%. Twenty prompts' divergence points are too noisy to see a small
  loss; perplexity is the sensitive test.

The fast tests check ``perplexity``'s windowing against a per-token computation on the tiny model,
and ``greedy_agreement``'s counting. Re-measure (numbers above) if the text, the prompts, the model
or the window change.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.model.loader import LoadedModel, load_model
from tests.helpers import quality
from tests.helpers.bundled_quality import (
    MIN_FRACTION_FIRST_4,
    MIN_MEAN_FIRST_DIVERGENCE,
    measure_quality,
    needs_native_bf16,
    read_text,
)
from tests.helpers.model_steps import prefill_logits

MAX_BF16_PPL_CHANGE = 0.003  # |ppl_bf16 / ppl_fp32 - 1|; measured 0.0004
# ---------------------------------------------------------------------- bundled model (slow)


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[quality.PerplexityResult, list[list[int]]]]:
    """{dtype: (perplexity of the text, greedy completions of the prompts)}, one model at a time."""
    return {dtype: measure_quality(dtype, "none") for dtype in ("float32", "bfloat16")}


@pytest.mark.slow
@needs_native_bf16
def test_bf16_perplexity_within_budget_of_fp32(measured):
    fp32, bf16 = measured["float32"][0], measured["bfloat16"][0]
    assert 2500 <= fp32.num_tokens <= 4000  # the text is what the thresholds were measured on
    assert 10 < fp32.ppl < 40, f"fp32 perplexity {fp32.ppl:.2f}: not a working model on English prose"
    change = bf16.increase_over(fp32)
    assert abs(change) <= MAX_BF16_PPL_CHANGE, (
        f"bf16 perplexity {bf16.ppl:.4f} vs fp32 {fp32.ppl:.4f}: {change:+.3%}"
    )


@pytest.mark.slow
@needs_native_bf16
def test_bf16_greedy_completions_track_fp32(measured):
    reference, candidate = measured["float32"][1], measured["bfloat16"][1]
    assert len(reference) >= 16
    agreement = quality.greedy_agreement(reference, candidate)
    detail = f"matched prefixes {agreement.matched_prefix} of {agreement.reference_lengths}"
    assert agreement.mean_first_divergence >= MIN_MEAN_FIRST_DIVERGENCE, detail
    assert agreement.fraction_matching_first(4) >= MIN_FRACTION_FIRST_4, detail


# ---------------------------------------------------------------------- tiny model (fast)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def text_ids(tiny) -> list[int]:
    ids = tiny.tokenizer.encode(read_text()[:1000])
    assert len(ids) > 100
    return ids[:100]


def per_token_reference(loaded: LoadedModel, ids: list[int], window: int, stride: int) -> torch.Tensor:
    """NLL of each token ``i + 1``, one prefill per token over exactly the context ``perplexity``
    documents: the first window ending after prediction ``i``, which reaches back ``window``."""
    num_preds = len(ids) - 1
    ends = [min(window, num_preds)]
    while ends[-1] < num_preds:
        ends.append(min(ends[-1] + stride, num_preds))
    nlls = []
    for i in range(num_preds):
        end = next(e for e in ends if e > i)
        context = ids[max(0, end - window) : i + 1]
        logits = prefill_logits(loaded.model, loaded.arch, context)[-1]
        nlls.append(-torch.log_softmax(logits.double(), -1)[ids[i + 1]])
    return torch.stack(nlls)


@pytest.mark.parametrize(
    ("window", "stride"),
    [(4096, None), (40, None), (33, 7)],
    ids=["one-window", "tiled", "sliding"],
)
def test_perplexity_scores_each_token_once_with_its_window_context(
    tiny, text_ids, window, stride, monkeypatch
):
    monkeypatch.setattr(quality, "_LOGIT_ROWS", 7)  # several logit chunks per window
    result = quality.perplexity(tiny, text_ids, window=window, stride=stride)
    expected = per_token_reference(tiny, text_ids, window, stride or window)
    assert result.num_tokens == len(text_ids) - 1
    torch.testing.assert_close(result.token_nlls, expected, atol=1e-4, rtol=1e-4)
    assert result.nll_sum == pytest.approx(float(expected.sum()), rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(result.nll_sum / result.num_tokens))


def test_perplexity_one_window_equals_sliding_when_window_covers_text(tiny, text_ids):
    whole = quality.perplexity(tiny, text_ids, window=len(text_ids))
    slid = quality.perplexity(tiny, text_ids, window=len(text_ids), stride=5)
    assert torch.equal(whole.token_nlls, slid.token_nlls)
    shorter = quality.perplexity(tiny, text_ids, window=32, stride=8)  # less context, other result
    assert shorter.nll_sum != whole.nll_sum


def test_perplexity_rejects_bad_arguments(tiny, text_ids):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        quality.perplexity(tiny, text_ids[:1])
    with pytest.raises(ValueError, match="stride"):
        quality.perplexity(tiny, text_ids, window=16, stride=17)
    with pytest.raises(ValueError, match="positions"):
        quality.perplexity(tiny, text_ids, window=tiny.arch.max_position_embeddings + 1)
    a = quality.perplexity(tiny, text_ids, window=32)
    with pytest.raises(ValueError, match="comparable"):
        a.increase_over(quality.perplexity(tiny, text_ids, window=64))


@pytest.mark.slow
def test_perplexity_matches_transformers_loss(tiny_model_dir, tiny, text_ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([text_ids])
    with torch.inference_mode():
        loss = hf(ids, labels=ids).loss.item()  # mean NLL of tokens 1.. given all before them
    result = quality.perplexity(tiny, text_ids, window=len(text_ids))
    assert result.nll_sum / result.num_tokens == pytest.approx(loss, rel=1e-5)


def test_greedy_agreement_counts_matched_prefixes():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9], [1, 2, 3, 4]]
    candidate = [[1, 2, 3, 4], [5, 6, 0, 8], [7, 9], [1, 2, 3, 4, 5]]  # last: reference hit EOS
    agreement = quality.greedy_agreement(reference, candidate)
    assert agreement.matched_prefix == (4, 2, 0, 4)
    assert agreement.reference_lengths == (4, 4, 2, 4)
    assert agreement.fraction_identical == 0.25
    assert agreement.mean_first_divergence == 2.5
    assert agreement.fraction_matching_first(1) == 0.75
    assert agreement.fraction_matching_first(3) == 0.5
    assert agreement.fraction_matching_first(100) == 0.5  # short references count when fully matched
    with pytest.raises(ValueError):
        quality.greedy_agreement(reference, candidate[:2])
