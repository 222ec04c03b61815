"""Measured quality of reduced-precision weights: perplexity on a text, greedy agreement with fp32.

Two numbers, each answering a different question about a cheaper copy of a model (bf16 weights
now; int8 per-channel and GGUF Q4 blocks next) against its float32 reference:

- **Perplexity** (``perplexity``): how well the model predicts a fixed text, averaged over every
  token. It moves smoothly with small numeric errors, so a *ratio* to the reference's
  perplexity on the same tokens is a stable, comparable budget ("bf16 within 1%").
- **Greedy agreement** (``greedy_agreement``): how long greedy completions stay token-for-token
  identical to the reference's. This is what a user sees, but it is all-or-nothing per step:
  two candidates a hair apart in logit can swap on any rounding, and every token after a swap
  is conditioned on a different prefix, so long completions diverge eventually even when the
  model is as good as before. Judge it on the matched prefix, not on full identity.

Perplexity runs the model's real serving path (one paged-attention prefill per window, the
same ``LlamaForCausalLM.forward`` and kernels the runner uses), so it measures what is served.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.bench.perplexity.pdserve_run import prefill_metadata

if TYPE_CHECKING:
    from pdserve import LLM
    from pdserve.engine.model.loader import LoadedModel
    from pdserve.engine.model.tokenizer import Tokenizer

# Rows of hidden state projected to the vocab at once: [rows, 49152] fp32 logits plus their
# log-softmax stay near 100 MB instead of scaling with the window.
_LOGIT_ROWS = 256


@dataclass(frozen=True)
class PerplexityResult:
    """Summed negative log-likelihood of the scored tokens (nats) and its perplexity.

    ``ppl = exp(nll_sum / num_tokens)``: the model is on average as unsure of the next token as
    a uniform choice among ``ppl`` tokens. Only results on the same token ids are comparable.
    """

    nll_sum: float
    num_tokens: int  # tokens scored: every token of the text but the first
    ppl: float
    window: int  # context tokens per forward pass (the longest context any token saw)
    stride: int  # new tokens scored per window after the first
    token_nlls: torch.Tensor = field(repr=False, compare=False)  # [num_tokens] float64, per token

    def increase_over(self, reference: PerplexityResult) -> float:
        """Relative perplexity increase over ``reference`` (``0.01`` = 1% higher)."""
        if self.num_tokens != reference.num_tokens or (self.window, self.stride) != (
            reference.window,
            reference.stride,
        ):
            raise ValueError("perplexities are comparable only on the same tokens, window and stride")
        return self.ppl / reference.ppl - 1.0


def perplexity(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    window: int = 1024,
    stride: int | None = None,
    block_size: int = 16,
    chunk: int | None = None,
) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``loaded.model``, in windows of one prefill each.

    The logit at input position ``i`` predicts token ``i + 1``; every token but the first is
    scored exactly once (nothing is prepended: pass a BOS yourself if the model wants one).

    Why windows: a forward pass costs attention quadratic in its length and must fit the
    model's positions, and a fixed window makes the number independent of how long the text is.
    The price is context: with ``stride == window`` (the default) the windows tile the text (the
    last one ends at the text's end and reaches back a full window) and a token just after a
    window boundary is predicted from very little context, which raises perplexity a little. A
    smaller ``stride`` slides the window by ``stride`` tokens and scores only the new ones, so
    every token after the first window sees at least ``window - stride`` tokens of context, at
    ``window / stride`` times the compute. Either way the result depends on (text, window,
    stride): compare two models only on the same ones.

    Each window is a fresh sequence at positions ``0..len-1`` in its own paged KV cache (one
    prefill, no cached prefix), run through ``LlamaForCausalLM.forward`` exactly as the runner
    would run a single prompt; logits are float32 and the log-softmax is taken in float32.

    ``chunk``: at most this many tokens a forward pass, each chunk attending to the window's
    earlier ones in the cache (chunked prefill; None: the whole window at once). Chunks within
    the quantized kernels' row limit (``quant_linear.KERNEL_MAX_ROWS``) run every projection and
    the LM head through the decode kernels, as a decode step does, where a whole-window prefill
    decodes the blocks for a dense GEMM instead: what ``--quantization gguf-a8`` changes is then
    measured too.
    """
    num_preds = len(token_ids) - 1
    if num_preds < 1:
        raise ValueError(f"token_ids: need at least 2 tokens to score one, got {len(token_ids)}")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    max_positions = loaded.arch.max_position_embeddings
    if window > max_positions:
        raise ValueError(f"window {window} exceeds the model's {max_positions} positions")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    model = loaded.model
    device, dtype = model.model.norm.weight.device, model.dtype

    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    longest = min(window, num_preds)
    num_blocks = -(-longest // block_size)
    kv_cache = loaded.arch.kv_cache_spec(block_size, dtype).allocate(num_blocks, device=device)
    token_nlls = torch.empty(num_preds, dtype=torch.float64)
    scored_to = 0  # predictions [0, scored_to) are done
    end = 0
    with torch.inference_mode():
        while scored_to < num_preds:
            # Anchored at its end, so the last window also gets the full context.
            end = min(end + (window if end == 0 else stride), num_preds)
            begin = max(0, end - window)
            length = end - begin
            step = length if chunk is None else chunk
            parts = []
            for start in range(0, length, step):
                stop = min(start + step, length)
                meta = prefill_metadata(stop - start, block_size, device, start=start)
                positions = torch.arange(start, stop, dtype=torch.long, device=device)
                parts.append(model(ids[begin + start : begin + stop], positions, kv_cache, meta))
            hidden = torch.cat(parts)  # [length, hidden]
            first = scored_to - begin  # rows already scored by an earlier window are skipped
            for row in range(first, length, _LOGIT_ROWS):
                rows = slice(row, min(row + _LOGIT_ROWS, length))
                logprobs = F.log_softmax(model.compute_logits(hidden[rows]), dim=-1)
                targets = ids[begin + 1 + rows.start : begin + 1 + rows.stop]
                nll = -logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
                token_nlls[begin + rows.start : begin + rows.stop] = nll.double().cpu()
            scored_to = end
    nll_sum = float(token_nlls.sum())
    return PerplexityResult(
        nll_sum=nll_sum,
        num_tokens=num_preds,
        ppl=math.exp(nll_sum / num_preds),
        window=window,
        stride=stride,
        token_nlls=token_nlls,
    )


@dataclass(frozen=True)
class AgreementResult:
    """How far each candidate completion agrees with its reference, token for token.

    ``matched_prefix[i]`` is the number of leading tokens prompt ``i``'s candidate shares with
    its reference: the position of the first divergence, or the full length when they never
    diverge (so ``mean_first_divergence`` is censored at the completion length).
    """

    matched_prefix: tuple[int, ...]  # per prompt
    reference_lengths: tuple[int, ...]  # per prompt
    fraction_identical: float  # prompts whose candidate equals the reference exactly
    mean_first_divergence: float  # mean of matched_prefix

    def fraction_matching_first(self, k: int) -> float:
        """Fraction of prompts whose first ``k`` tokens agree (or whose reference is shorter
        than ``k`` and fully agrees)."""
        agreed = [m >= min(k, n) for m, n in zip(self.matched_prefix, self.reference_lengths, strict=True)]
        return sum(agreed) / len(agreed)


def greedy_agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> AgreementResult:
    """Compare completions of the same prompts (reference: fp32), prompt by prompt."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference completions but {len(candidate)} candidates")
    if not reference:
        raise ValueError("no completions to compare")
    matched: list[int] = []
    identical = 0
    for ref, cand in zip(reference, candidate, strict=True):
        n = 0
        for a, b in zip(ref, cand, strict=False):
            if a != b:
                break
            n += 1
        matched.append(n)
        identical += list(ref) == list(cand)
    return AgreementResult(
        matched_prefix=tuple(matched),
        reference_lengths=tuple(len(ref) for ref in reference),
        fraction_identical=identical / len(reference),
        mean_first_divergence=sum(matched) / len(matched),
    )


def load_prompts(path: str, tokenizer: Tokenizer) -> list[str]:
    """A prompt set file as prompt strings: ``[{"chat": question} | {"text": prefix}, ...]``.

    A ``chat`` entry is a user turn rendered with the model's chat template (generation prompt
    added); a ``text`` entry is a plain prefix to continue.
    """
    with open(path, encoding="utf-8") as f:
        entries: list[dict[str, Any]] = json.load(f)
    prompts: list[str] = []
    for i, entry in enumerate(entries):
        if "chat" in entry:
            messages = [{"role": "user", "content": entry["chat"]}]
            prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        elif "text" in entry:
            prompts.append(entry["text"])
        else:
            raise ValueError(f"{path}: entry {i} has neither 'chat' nor 'text'")
    return prompts


def greedy_completions(llm: LLM, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Greedy completion token ids of every prompt, in one batch through the full engine."""
    from pdserve.engine.request import SamplingParams

    outputs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(out.token_ids) for out in outputs]
