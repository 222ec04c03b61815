"""llama.cpp's perplexity scheme (``tools/perplexity/perplexity.cpp``, ``perplexity()`` without
``--ppl-stride``), as numbers any model's logits can be scored by.

- the text is tokenized whole, with the model's add-BOS rule, after ``-f`` drops one trailing
  newline (``text_as_llamacpp_reads_it``);
- the tokens are cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx`` (``--chunks`` caps the
  count; a tail shorter than ``n_ctx`` is never scored, and fewer than ``2 * n_ctx`` tokens is an
  error);
- each chunk is a fresh sequence at positions ``0..n_ctx-1`` whose first token is replaced by BOS
  when the vocab adds one (``chunk_inputs``);
- only the second half is scored: the logits at positions ``first = n_ctx // 2`` to
  ``n_ctx - 2`` against the tokens at ``first + 1`` to ``n_ctx - 1``, so every scored token has at
  least ``n_ctx // 2`` tokens of context and each chunk scores ``n_ctx - first - 1`` of them;
- a token's NLL is ``-(logit[tok] - max - log(sum(exp(logit - max))))`` with the sum in double,
  and the perplexity is ``exp`` of the mean NLL over every scored token of every chunk, with
  llama.cpp's ``+/-`` (the standard error of the mean NLL, times the perplexity) (``NllTally``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Logit rows turned to float64 at once: [rows, vocab] stays near 70 MB for Gemma's 262144.
_NLL_ROWS = 32


def text_as_llamacpp_reads_it(raw: str) -> str:
    """The prompt ``llama-perplexity -f FILE`` tokenizes: the file with one trailing ``\\n``
    dropped (``common/arg.cpp``, ``-f``), no escapes processed (the tool sets ``escape = false``)."""
    return raw[:-1] if raw.endswith("\n") else raw


@dataclass(frozen=True)
class Chunking:
    """Where llama.cpp cuts a text of ``num_tokens`` tokens, and what it scores of each chunk."""

    n_ctx: int
    num_chunks: int
    bos_id: int | None  # the token a chunk starts with (None: the vocab adds no BOS, kept as is)

    @property
    def first(self) -> int:
        """The first position whose logits are scored (``n_ctx / 2`` in the C++)."""
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - self.first - 1

    @property
    def num_scored(self) -> int:
        return self.num_chunks * self.scored_per_chunk


def plan(num_tokens: int, n_ctx: int, max_chunks: int | None, bos_id: int | None) -> Chunking:
    """The chunks llama.cpp makes of ``num_tokens`` tokens: ``num_tokens // n_ctx``, at most
    ``max_chunks`` (``--chunks``; None: all). Raises ``ValueError`` where llama.cpp refuses."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4 (half of it is scored), got {n_ctx}")
    if num_tokens < 2 * n_ctx:
        raise ValueError(
            f"the text tokenizes to {num_tokens} tokens; llama-perplexity needs at least 2 * n_ctx = "
            f"{2 * n_ctx} (a shorter --ctx, or a longer text)"
        )
    num_chunks = num_tokens // n_ctx
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"--chunks must be positive, got {max_chunks}")
        num_chunks = min(num_chunks, max_chunks)
    return Chunking(n_ctx, num_chunks, bos_id)


def chunk_inputs(tokens: Sequence[int], chunking: Chunking, index: int) -> list[int]:
    """The ``n_ctx`` token ids chunk ``index`` is evaluated on: the text's, its first one
    replaced by BOS when the vocab adds one (the scored targets are never the replaced one)."""
    if not 0 <= index < chunking.num_chunks:
        raise IndexError(f"chunk {index} of {chunking.num_chunks}")
    start = index * chunking.n_ctx
    ids = list(tokens[start : start + chunking.n_ctx])
    if chunking.bos_id is not None:
        ids[0] = chunking.bos_id
    return ids


def scored_nlls(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[rows]`` float64 NLLs of ``targets`` (``[rows]``) under ``logits`` (``[rows, vocab]``,
    float32 as a model returns them), as llama.cpp's ``log_softmax``: shifted by the row's max,
    the exponentials summed in double."""
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} targets")
    out = torch.empty(logits.shape[0], dtype=torch.float64)
    for row in range(0, logits.shape[0], _NLL_ROWS):
        block = logits[row : row + _NLL_ROWS].float()
        shifted = (block - block.max(dim=1, keepdim=True).values).double()
        picked = shifted.gather(1, targets[row : row + _NLL_ROWS].view(-1, 1).long()).squeeze(1)
        out[row : row + block.shape[0]] = torch.logsumexp(shifted, dim=1) - picked
    return out


@dataclass
class NllTally:
    """The running sums ``llama-perplexity`` keeps: scored tokens, and their NLLs and squares.

    Its ``[i]X,`` progress values are ``running_ppl()`` after each chunk."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    chunk_ppls: list[float] = field(default_factory=list)  # the running perplexity after each chunk

    def add_chunk(self, nlls: torch.Tensor) -> None:
        values = nlls.double()
        self.count += values.numel()
        self.nll += float(values.sum())
        self.nll2 += float((values * values).sum())
        self.chunk_ppls.append(self.running_ppl())

    def running_ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def estimate(self) -> tuple[float, float]:
        """``Final estimate: PPL = ppl +/- error``: the perplexity and the standard error of
        the mean NLL times it (0 when all NLLs are equal)."""
        if self.count < 2:
            raise ValueError(f"need at least 2 scored tokens, have {self.count}")
        mean = self.nll / self.count
        variance = self.nll2 / self.count - mean * mean
        ppl = math.exp(mean)
        return ppl, math.sqrt(max(variance, 0.0) / (self.count - 1)) * ppl
