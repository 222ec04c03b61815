"""Token sampling from a batch of logits: greedy, temperature, top-k, top-p, per-request seeds.

A request with a ``seed`` owns a ``torch.Generator``, so its draws depend only on its own
history, never on which other requests happened to share the batch.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(params.seed)
    return generator


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus of one row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p (keeps at least one).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, sorted_idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,  # [num_reqs, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; others are overwritten
    for row, p in enumerate(params):
        if p.greedy:
            continue
        row_logits = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = row_logits.softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())
    return tokens
