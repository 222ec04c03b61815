"""The requests of ``pdserve bench serve``: how long each prompt and output is, when each arrives,
and which token ids it carries, all seeded.

``RequestSpec`` (one request) lives here, apart from the driver that sends them
(``pdserve.bench.serve.driver``), the client that streams them (``client``) and the report that
judges what came back (``report``): each of those imports it from here and none imports another
back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    """One request: its place in the run, when it arrives, its prompt and its output length."""

    index: int
    arrival_s: float  # offset from the start of the rate's run
    prompt_token_ids: list[int]
    output_len: int


def parse_length(text: str) -> tuple[int, int]:
    """``"512"`` -> (512, 512); ``"128:1024"`` -> uniform in [128, 1024]."""
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"bad length {text!r}: want N or LO:HI with 1 <= LO <= HI")
    return bounds


def load_dataset(path: str) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` pairs from a JSONL file of ``{"prompt_len", "output_len"}``."""
    pairs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                pair = (int(row["prompt_len"]), int(row["output_len"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"{path}:{number}: want prompt_len and output_len integers ({exc})"
                ) from None
            if min(pair) < 1:
                raise ValueError(f"{path}:{number}: lengths must be >= 1, got {pair}")
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: no rows")
    return pairs


@dataclass
class OpenLoopWorkload:
    """Draws the requests of one rate of the open loop: lengths, Poisson arrival times and token
    ids, all seeded."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    dataset: list[tuple[int, int]] | None
    shared_prefix_frac: float
    seed: int
    token_range: tuple[int, int]  # [lo, hi) of the token ids drawn
    shared_prefix: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        longest = max(p for p, _ in self.dataset) if self.dataset else self.prompt_len[1]
        rng = np.random.default_rng([self.seed, 7])
        # Request i uses the first frac * prompt_len tokens of this one sequence as its prefix.
        self.shared_prefix = rng.integers(*self.token_range, size=longest).tolist()

    def mean_lengths(self) -> tuple[float, float]:
        """Expected (prompt, output) length of a request: what the chunk sweep calibrates for."""
        if self.dataset:
            return float(np.mean([p for p, _ in self.dataset])), float(np.mean([o for _, o in self.dataset]))
        return sum(self.prompt_len) / 2, sum(self.output_len) / 2

    def max_total_len(self) -> int:
        if self.dataset:
            return max(p + o for p, o in self.dataset)
        return self.prompt_len[1] + self.output_len[1]

    def draw(self, num_requests: int, rate: float, stream: int) -> list[RequestSpec]:
        """Requests of rate-stream ``stream`` (a different stream gives different prompts)."""
        rng = np.random.default_rng([self.seed, 1000 + stream])
        if self.dataset:
            picks = rng.integers(len(self.dataset), size=num_requests)
            lengths = [self.dataset[i] for i in picks]
        else:
            prompts = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, size=num_requests)
            outputs = rng.integers(self.output_len[0], self.output_len[1] + 1, size=num_requests)
            lengths = list(zip(prompts.tolist(), outputs.tolist(), strict=True))
        if np.isinf(rate):
            arrivals = np.zeros(num_requests)
        else:
            gaps = rng.exponential(1.0 / rate, size=num_requests)
            arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        specs = []
        for i, ((p, o), arrival) in enumerate(zip(lengths, arrivals.tolist(), strict=True)):
            shared = min(p, int(self.shared_prefix_frac * p))
            own = rng.integers(*self.token_range, size=p - shared).tolist()
            specs.append(RequestSpec(i, arrival, self.shared_prefix[:shared] + own, int(o)))
        return specs
