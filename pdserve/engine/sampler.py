"""Token sampling from a batch of logits, in vLLM v1's order.

1. ``min_tokens``: until a request has generated that many tokens, EOS and its stop token ids
   get -inf (vLLM masks EOS even with ``ignore_eos``).
2. Penalties: ``repetition_penalty`` (vLLM: every token seen in the prompt or the output has its
   logit divided by it if positive, multiplied if not), then OpenAI's ``frequency_penalty``
   (times the token's count in the output) and ``presence_penalty`` (once if it occurs).
3. Greedy rows take the argmax of the penalised logits; the others divide by ``temperature``,
   drop tokens below ``min_p`` x the top probability, apply top-k and top-p, and draw.

A seeded request draws its k-th output token from a generator seeded with (seed, k): its tokens
depend only on its own seed and history, never on the batch it shared, and are the same whether
it ran on one engine or was split between a prefill engine (token 0) and a decode engine (the
rest; they count the prefill's token through ``num_prior_output_tokens``), or was preempted and
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.request import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """A 64-bit seed for draw ``index`` of a request seeded with ``seed`` (splitmix64 of both):
    neighbouring seeds or indices give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    )


@dataclass
class SamplingState:
    """What the sampler keeps of one request between steps.

    ``output_counts`` ([vocab] counts of the output tokens so far, prior outputs included) and
    ``prompt_mask`` ([vocab], True for tokens of the prompt proper) exist only for a request
    that uses penalties, and are updated one token at a time.
    """

    params: SamplingParams
    eos_token_id: int | None
    num_generated: int = 0  # tokens this engine has sampled for it (min_tokens counts these)
    output_counts: torch.Tensor | None = field(default=None, repr=False)
    prompt_mask: torch.Tensor | None = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        eos_token_id: int | None,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        vocab_size: int,
    ) -> SamplingState:
        """``prompt_token_ids`` as the engine got them (with any prior outputs at the end);
        ``output_token_ids`` generated here so far (non-empty after a preemption)."""
        state = cls(params, eos_token_id, num_generated=len(output_token_ids))
        if uses_penalties(params):
            # Clamped: a caller that did not check num_prior_output_tokens < len(prompt) gets
            # "all of the prompt is prior output", not a slice from the wrong end.
            split = max(0, len(prompt_token_ids) - params.num_prior_output_tokens)
            state.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
            state.prompt_mask[torch.tensor(prompt_token_ids[:split], dtype=torch.long)] = True
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32)
            outputs = prompt_token_ids[split:] + list(output_token_ids)
            if outputs:
                state.output_counts.index_add_(
                    0, torch.tensor(outputs, dtype=torch.long), torch.ones(len(outputs))
                )
        if not params.greedy and params.seed is not None:
            state.generator = torch.Generator()
        return state

    @property
    def draw_index(self) -> int:
        """Which output token of the request the next draw is (prior outputs included)."""
        return self.params.num_prior_output_tokens + self.num_generated

    def append(self, token: int) -> None:
        self.num_generated += 1
        if self.output_counts is not None:
            self.output_counts[token] += 1


def apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """In place: -inf on EOS and stop ids of rows that have not reached min_tokens."""
    for row, state in enumerate(states):
        if state.num_generated >= state.params.min_tokens:
            continue
        banned = list(state.params.stop_token_ids)
        if state.eos_token_id is not None:
            banned.append(state.eos_token_id)
        if banned:
            logits[row, banned] = float("-inf")


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, batched over the rows that use them."""
    rows = [row for row, state in enumerate(states) if state.output_counts is not None]
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.long)
    counts = torch.stack([states[r].output_counts for r in rows])  # type: ignore[misc]
    prompt_mask = torch.stack([states[r].prompt_mask for r in rows])  # type: ignore[misc]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(states[r].params, name) for r in rows], dtype=logits.dtype).unsqueeze(1)

    selected = logits[index]
    repetition = column("repetition_penalty")
    seen = prompt_mask | (counts > 0)
    penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, penalised, selected)
    selected = selected - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    logits = logits.clone()
    logits[index] = selected
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """One row: -inf where the probability is below ``min_p`` x the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


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


def processed_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """The batch's logits after min_tokens masking and penalties (what greedy takes the argmax of)."""
    if any(s.num_generated < s.params.min_tokens for s in states):
        logits = logits.clone()
        apply_min_tokens(logits, states)
    return apply_penalties(logits, states)


def sampling_distribution(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One non-greedy row's probabilities (after processed_logits): temperature, min_p, top-k, top-p."""
    row_logits = apply_min_p(row_logits / params.temperature, params.min_p)
    return apply_top_k_top_p(row_logits, params.top_k, params.top_p).softmax(-1)


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """One token per row (``logits``: [num_reqs, vocab] float32); the states are advanced."""
    logits = processed_logits(logits, states)
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; others are overwritten
    for row, state in enumerate(states):
        params = state.params
        if not params.greedy:
            generator = state.generator
            if generator is not None:
                generator.manual_seed(draw_seed(params.seed, state.draw_index))  # type: ignore[arg-type]
            probs = sampling_distribution(logits[row], params)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
        state.append(tokens[row])
    return tokens
