"""Offline request workloads for throughput benchmarks: how long each prompt and each output is.

The default mix is ShareGPT-like: real chat traffic has a long right tail in both prompt and
output lengths, which is what separates continuous batching from static batching (a static
batch runs as long as its longest member). Lengths are drawn from seeded lognormals whose
unclipped means (~215 prompt, ~205 output tokens) are close to what vLLM's ShareGPT benchmark
reports (~215 input and ~200 output tokens per request), then clipped to the given ranges.
A JSONL file of ``{"prompt_len": .., "output_len": ..}`` lines replaces the draw.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.bench.common.stats import median, percentile

MIN_LEN = 16
# Lognormal (median, sigma) per length: mean = median * exp(sigma^2 / 2).
PROMPT_LOGNORMAL = (130.0, 1.0)
OUTPUT_LOGNORMAL = (150.0, 0.8)
# Ids below this are skipped when drawing prompt tokens: tokenizers put their special tokens
# (BOS, EOS, chat markers) first, and a prompt full of them is not a prompt.
FIRST_ORDINARY_ID = 100


@dataclass
class OfflineWorkload:
    """One prompt (token ids) and one output length per request, in submission order."""

    prompts: list[list[int]]
    output_lens: list[int]
    source: str  # "lognormal(seed=..)" or the lengths file

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def summary(self) -> dict:
        """Sizes a reader needs to judge the mix: per-length stats and totals."""
        return {
            "source": self.source,
            "num_requests": len(self),
            "prompt_len": _stats(self.prompt_lens),
            "output_len": _stats(self.output_lens),
            "total_prompt_tokens": sum(self.prompt_lens),
            "total_output_tokens": sum(self.output_lens),
        }


def _stats(values: list[int]) -> dict:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "mean": statistics.fmean(ordered),
        "median": median(ordered),
        "p90": percentile(ordered, 90),
        "max": ordered[-1],
    }


def sharegpt_like_lengths(
    num_requests: int, seed: int, max_prompt_len: int, max_output_len: int
) -> list[tuple[int, int]]:
    """``num_requests`` seeded (prompt_len, output_len) pairs, clipped to [16, max]."""
    rng = np.random.default_rng(seed)

    def draw(median_sigma: tuple[float, float], upper: int) -> np.ndarray:
        mid, sigma = median_sigma
        values = np.rint(rng.lognormal(math.log(mid), sigma, num_requests))
        return np.clip(values, min(MIN_LEN, upper), upper).astype(int)

    prompts = draw(PROMPT_LOGNORMAL, max_prompt_len)
    outputs = draw(OUTPUT_LOGNORMAL, max_output_len)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


def read_lengths(path: str) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs from a JSONL file; each must be a positive integer."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            try:
                pair = (int(record["prompt_len"]), int(record["output_len"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: need integer prompt_len and output_len") from exc
            if min(pair) < 1:
                raise ValueError(f"{path}:{lineno}: lengths must be >= 1, got {pair}")
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: no lengths")
    return pairs


def build_workload(
    lengths: list[tuple[int, int]], vocab_size: int, seed: int, source: str
) -> OfflineWorkload:
    """Random in-vocabulary prompts (seeded) of the given lengths.

    Random ids defeat any prefix cache, so both engines compute every prompt token.
    """
    low = min(FIRST_ORDINARY_ID, vocab_size // 2)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(low, vocab_size, (p,), generator=generator).tolist() for p, _ in lengths]
    return OfflineWorkload(prompts=prompts, output_lens=[o for _, o in lengths], source=source)
