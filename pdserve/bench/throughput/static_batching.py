"""Hugging Face transformers as a static-batching baseline: left-padded ``generate`` batches.

Static batching is how one serves offline with transformers: a batch is padded to its longest
prompt and decodes until its longest output is done, so shorter members ride along. To give it
its best case, requests are sorted by (output length, prompt length) before being cut into
batches (similar lengths share a batch, little padding or overrun), and the batch size is swept.

The sweep is time-boxed: each batch size runs whole batches drawn in a seeded random order from
its own batching of the full workload until ``budget_s`` has passed, which samples the same
length mix the full run would see. The fastest batch size then finishes its remaining batches,
so the reported transformers number is the full workload at that size, every output produced
once. Throughput counts only the tokens each request asked for, not the overrun.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.bench.throughput.workload import OfflineWorkload

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class BatchSizeRun:
    """What one batch size has done so far: batches run, their outputs and their wall time."""

    batch_size: int
    batches: list[list[int]]  # request indices per batch, sorted by length
    order: list[int]  # batch indices in the order they run (seeded shuffle)
    done: int = 0  # order[:done] have run
    seconds: float = 0.0
    output_tokens: int = 0  # tokens the finished requests asked for
    outputs: dict[int, list[int]] = field(default_factory=dict)  # {request index: token ids}

    @property
    def complete(self) -> bool:
        return self.done == len(self.order)

    def row(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "batches_run": self.done,
            "num_batches": len(self.order),
            "requests": len(self.outputs),
            "output_tokens": self.output_tokens,
            "seconds": self.seconds,
            "req_per_s": len(self.outputs) / self.seconds,
            "out_tok_per_s": self.output_tokens / self.seconds,
            "complete": self.complete,
        }


def length_sorted_batches(workload: OfflineWorkload, batch_size: int) -> list[list[int]]:
    """Request indices cut into batches after sorting by (output length, prompt length)."""
    order = sorted(range(len(workload)), key=lambda i: (workload.output_lens[i], len(workload.prompts[i])))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class StaticBatchRunner:
    """Runs left-padded greedy ``generate`` batches on one transformers model."""

    def __init__(self, model: PreTrainedModel, workload: OfflineWorkload, seed: int) -> None:
        self.model = model
        self.workload = workload
        self.seed = seed
        config = model.config
        self.pad_id = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
        # Greedy, never stopped by EOS, and EOS never masked: that is what pdserve's
        # ignore_eos does. (min_new_tokens would instead give EOS -inf and change greedy picks.)
        self.generation_config = copy.deepcopy(model.generation_config)
        self.generation_config.eos_token_id = None
        self.generation_config.pad_token_id = self.pad_id
        self.generation_config.do_sample = False

    def new_run(self, batch_size: int) -> BatchSizeRun:
        batches = length_sorted_batches(self.workload, batch_size)
        order = np.random.default_rng(self.seed).permutation(len(batches)).tolist()
        return BatchSizeRun(batch_size, batches, order)

    def advance(
        self,
        run: BatchSizeRun,
        budget_s: float | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        """Run ``run``'s next batches: at least one, then until ``budget_s`` of its time has
        passed (``None``: all of them). ``on_batch`` gets each batch's output token count."""
        start_seconds = run.seconds
        while not run.complete:
            batch = run.batches[run.order[run.done]]
            seconds, outputs = self.generate(batch)
            run.seconds += seconds
            run.done += 1
            tokens = 0
            for index, token_ids in zip(batch, outputs, strict=True):
                run.outputs[index] = token_ids
                tokens += len(token_ids)
            run.output_tokens += tokens
            if on_batch is not None:
                on_batch(tokens)
            if budget_s is not None and run.seconds - start_seconds >= budget_s:
                return

    @torch.inference_mode()
    def generate(self, batch: list[int]) -> tuple[float, list[list[int]]]:
        """One left-padded batch; returns its wall time and each request's requested tokens."""
        prompts = [self.workload.prompts[i] for i in batch]
        want = [self.workload.output_lens[i] for i in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        config = copy.copy(self.generation_config)
        config.max_new_tokens = max(want)
        start = time.perf_counter()
        generated = self.model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
        seconds = time.perf_counter() - start
        new_tokens = generated[:, width:].tolist()
        return seconds, [tokens[:n] for tokens, n in zip(new_tokens, want, strict=True)]
