"""Chunked-prefill calibration for ``pdserve bench serve``'s ``colocated-chunked`` setup.

A colocated engine that runs a 512-token prompt as one step stalls every request decoding on
it for that whole step (~2 s on one core of this project's machine); that is the baseline P/D's
inter-token-latency win is measured against. The strongest colocated configuration instead
caps each step at a token budget so that a step carrying a prefill chunk costs about one decode
step (Sarathi-Serve's stall-free batching): decodes go first, the prefill gets what is left of
the budget. The budget is the engine's ``max_num_batched_tokens``; what it should be depends on
the model, the CPU and the decode batch, so it is measured, not guessed:

1. ``batch`` requests are prefilled to the workload's prompt length and left decoding (the
   decode batch a colocated engine typically holds under the benchmark's load; see
   ``typical_decode_batch``).
2. For each candidate budget ``T`` (and ``None``: no chunking, the plain colocated engine), a
   few pure decode steps are timed, then one more prompt of the workload's length is added and
   every step until its first token is timed: each such step is ``batch`` decodes plus a
   ``T - batch``-token chunk, exactly what the engine will run.
3. The rule (``choose_chunk``): the largest ``T`` whose median mixed step is at most
   ``max_ratio`` x the median decode step. When none is (a slow CPU where even a small chunk
   outweighs a decode step), the strongest baseline is the one the benchmark's SLO favours:
   the largest ``T`` whose mixed step still fits the inter-token SLO (``max_step_ms``), since
   a larger chunk finishes the prompt in fewer steps (better TTFT) at no SLO cost; if none
   fits either, the smallest candidate, as the closest to stall-free. (On this project's CPU
   no budget meets 1.5x, and always taking the smallest, 32, made a 512-token prompt take 17
   steps and 3.4 s: a baseline that could not meet a 3 s TTFT even unloaded.)

Every candidate runs on the same engine, the same running batch and the same KV contexts (only
the scheduler's budget changes between them), so the ratios compare like with like. Run as
``python -m pdserve.bench.serve.chunk_sweep``, pinned to one core with ``OMP_NUM_THREADS=1`` like the
engines it calibrates (``run_pinned``); it writes its result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

DEFAULT_CANDIDATES = (32, 64, 128, 256)
DEFAULT_MAX_RATIO = 1.5
# The engines' --max-num-seqs default; a budget below it must lower it (every running sequence
# needs a token per step, so SchedulerConfig refuses max_num_seqs > max_num_batched_tokens).
ENGINE_MAX_NUM_SEQS = 64
DECODE_STEPS = 6  # pure decode steps timed per candidate and repeat
MAX_BATCH = 16  # the largest decode batch the sweep builds (Little's law is capped here)
SWEEP_TIMEOUT_S = 900.0


def typical_decode_batch(rate_per_engine: float, mean_output_len: float, decode_step_s: float) -> int:
    """Requests decoding at once on one engine, by Little's law: arrivals per second times the
    time each spends decoding (``output_len`` steps), rounded up, at least 1. An infinite rate
    (everything at once) has no steady state: the caller passes its own batch instead."""
    return max(1, math.ceil(rate_per_engine * mean_output_len * decode_step_s))


def engine_args_for_budget(tokens: int) -> list[str]:
    """Engine flags of the ``colocated-chunked`` setup: a step never carries more than
    ``tokens`` tokens, decodes included (``max_num_seqs`` lowered to fit when needed)."""
    return ["--max-num-batched-tokens", str(tokens), "--max-num-seqs", str(min(tokens, ENGINE_MAX_NUM_SEQS))]


def choose_chunk(
    sweep: Sequence[dict[str, Any]], max_ratio: float, max_step_ms: float | None = None
) -> tuple[int, str]:
    """(budget, why) by the module's rule over the ``sweep`` rows of chunked candidates;
    ``max_step_ms`` is the inter-token SLO used when no budget is within ``max_ratio``."""
    chunked = sorted((r for r in sweep if r["tokens"] is not None), key=lambda r: r["tokens"])
    if not chunked:
        raise ValueError("no chunked candidate in the sweep")
    fitting = [r for r in chunked if r["ratio"] <= max_ratio]
    if fitting:
        best = fitting[-1]
        return best["tokens"], (
            f"largest budget whose step ({best['mixed_step_ms']:.3g} ms) is <= {max_ratio:g}x a decode "
            f"step ({best['decode_step_ms']:.3g} ms): {best['ratio']:.2f}x"
        )
    within_slo = [r for r in chunked if max_step_ms is not None and r["mixed_step_ms"] <= max_step_ms]
    if within_slo:
        best = within_slo[-1]
        return best["tokens"], (
            f"no budget keeps a step within {max_ratio:g}x a decode step; largest budget whose step "
            f"({best['mixed_step_ms']:.3g} ms, {best['ratio']:.2f}x) fits the {max_step_ms:g} ms inter-token SLO"
        )
    best = chunked[0]
    return best["tokens"], (
        f"no budget keeps a step within {max_ratio:g}x a decode step; the smallest candidate costs "
        f"{best['ratio']:.2f}x ({best['mixed_step_ms']:.3g} vs {best['decode_step_ms']:.3g} ms)"
    )


# ---------------------------------------------------------------------- measurement (in the pinned child)


def _timed_step(engine) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - start, outputs


def measure(
    model: str | None,
    prompt_len: int,
    output_len: float,
    candidates: Sequence[int],
    batch: int | None,
    rate_per_engine: float,
    repeats: int,
    max_model_len: int,
    seed: int,
) -> dict[str, Any]:
    """The sweep described in the module docstring; returns ``{"batch", "rows", ...}``."""
    import numpy as np

    from pdserve.config import CacheConfig, SchedulerConfig
    from pdserve.engine.core import EngineCore, EngineCoreRequest
    from pdserve.engine.model.loader import load_model
    from pdserve.engine.request import SamplingParams

    loaded = load_model(model)
    vocab = loaded.arch.vocab_size
    rng = np.random.default_rng([seed, 99])
    # The decodes must last the whole sweep and the KV cache hold them: bound the steps it takes
    # (Little's law rounds, a prefill per request added, then every candidate's decode steps and
    # chunked prefill), counting the slowest case, a batch of MAX_BATCH.
    unchunked = max(2048, prompt_len + MAX_BATCH)
    budgets = [unchunked, *candidates]
    steps_bound = (4 * DECODE_STEPS + MAX_BATCH) + repeats * sum(
        DECODE_STEPS + 1 + math.ceil(prompt_len / max(1, t - MAX_BATCH)) for t in budgets
    )
    decode_max_tokens = min(steps_bound, max_model_len - prompt_len)
    blocks_per_req = math.ceil((prompt_len + decode_max_tokens + 1) / 16)
    engine = EngineCore(
        loaded,
        SchedulerConfig(
            max_num_batched_tokens=unchunked, max_num_seqs=MAX_BATCH + 1, max_model_len=max_model_len
        ),
        CacheConfig(block_size=16, num_blocks=(MAX_BATCH + 2) * blocks_per_req, enable_prefix_caching=False),
    )
    ids = iter(range(1 << 30))

    def add(max_tokens: int) -> str:
        request_id = f"sweep-{next(ids)}"
        prompt = rng.integers(min(256, vocab // 4), vocab, size=prompt_len).tolist()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(EngineCoreRequest(request_id, prompt, params))
        return request_id

    def run_until_first_token(request_id: str) -> list[float]:
        steps = []
        while True:
            elapsed, outputs = _timed_step(engine)
            steps.append(elapsed)
            if any(o.request_id == request_id and o.new_token_ids for o in outputs):
                return steps

    def decode_steps(count: int) -> list[float]:
        return [_timed_step(engine)[0] for _ in range(count)]

    # Warm up, and time a batch-1 decode step for Little's law.
    run_until_first_token(add(decode_max_tokens))
    decode_step_1 = statistics.median(decode_steps(DECODE_STEPS))
    running = 1
    if batch is None:
        # A bigger batch makes each step slower, which keeps requests decoding longer: iterate
        # Little's law on the step time measured at the batch reached, a few times at most.
        batch = min(MAX_BATCH, typical_decode_batch(rate_per_engine, output_len, decode_step_1))
        for _ in range(3):
            while running < batch:
                run_until_first_token(add(decode_max_tokens))
                running += 1
            step_s = statistics.median(decode_steps(DECODE_STEPS))
            wanted = min(MAX_BATCH, typical_decode_batch(rate_per_engine, output_len, step_s))
            if wanted <= batch:
                break
            batch = wanted
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be in [1, {MAX_BATCH}], got {batch}")
    while running < batch:
        run_until_first_token(add(decode_max_tokens))
        running += 1

    def set_budget(tokens: int | None) -> None:
        # Only the step budget changes between candidates: same engine, batch and KV contexts.
        budget = unchunked if tokens is None else max(tokens, batch + 1)
        config = dataclasses.replace(
            engine.scheduler.scheduler_config,
            max_num_batched_tokens=budget,
            max_num_seqs=min(budget, MAX_BATCH + 1),
        )
        engine.scheduler.scheduler_config = engine.scheduler_config = config

    samples: dict[int | None, dict[str, list[float]]] = {
        t: {"decode": [], "mixed": [], "prefill": []} for t in (None, *candidates)
    }
    for _ in range(repeats):
        for tokens in (None, *candidates):  # interleaved, so a burst of load hits every candidate
            if len(engine.scheduler.running) < batch:
                raise ValueError(
                    f"max_model_len {max_model_len} leaves the decodes too few tokens for the sweep"
                )
            set_budget(tokens)
            samples[tokens]["decode"] += decode_steps(DECODE_STEPS)
            steps = run_until_first_token(add(1))
            samples[tokens]["prefill"].append(sum(steps))
            # The last step carries only what was left of the prompt: not a full chunk.
            samples[tokens]["mixed"] += steps[:-1] if len(steps) > 1 else steps
    rows = []
    for tokens, times in samples.items():
        decode_ms = statistics.median(times["decode"]) * 1e3
        mixed_ms = statistics.median(times["mixed"]) * 1e3
        rows.append(
            {
                "tokens": tokens,
                "decode_step_ms": decode_ms,
                "mixed_step_ms": mixed_ms,
                "ratio": mixed_ms / decode_ms,
                "prefill_ms": statistics.median(times["prefill"]) * 1e3,
                "steps_per_prefill": math.ceil(prompt_len / max(1, (tokens or unchunked) - batch)),
            }
        )
    return {
        "batch": batch,
        "decode_step_batch1_ms": decode_step_1 * 1e3,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "threads": _torch_threads(),
        "rows": rows,
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.serve.chunk_sweep", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--output-len", type=float, required=True, help="mean output length (Little's law)")
    p.add_argument("--candidates", type=int, nargs="+", default=list(DEFAULT_CANDIDATES))
    p.add_argument("--batch", type=int, default=None, help="decode batch (default: Little's law)")
    p.add_argument("--rate-per-engine", type=float, default=0.0, help="req/s each engine receives")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="where to write the result")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(
        args.model, args.prompt_len, args.output_len, args.candidates, args.batch,
        args.rate_per_engine, args.repeats, args.max_model_len, args.seed,
    )  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------- driver (in bench serve)


def run_pinned(
    cpu: int,
    log_dir: str,
    env: dict[str, str],
    *,
    model: str | None,
    prompt_len: int,
    output_len: float,
    candidates: Sequence[int],
    batch: int | None,
    rate_per_engine: float,
    repeats: int,
    max_model_len: int,
    seed: int,
) -> dict[str, Any]:
    """Run the sweep in a child pinned to ``cpu`` (``env`` sets one thread, as for the engines),
    so it sees the same core and threading as the engines it calibrates; the child is killed if
    this process is interrupted or the sweep overruns ``SWEEP_TIMEOUT_S``."""
    from pdserve.supervisor import SupervisedProcess, SupervisorError

    out = os.path.join(log_dir, "chunk_sweep.json")
    argv = [
        sys.executable, "-m", "pdserve.bench.serve.chunk_sweep", "--prompt-len", str(prompt_len),
        "--output-len", str(output_len), "--candidates", *map(str, candidates),
        "--rate-per-engine", str(rate_per_engine), "--repeats", str(repeats),
        "--max-model-len", str(max_model_len), "--seed", str(seed), "--json", out,
    ]  # fmt: skip
    if model:
        argv += ["--model", model]
    if batch is not None:
        argv += ["--batch", str(batch)]
    child = SupervisedProcess(
        "chunk-sweep", argv, os.path.join(log_dir, "chunk_sweep.log"), env=env, cpus={cpu}
    )
    child.spawn()
    try:
        code = child.wait(timeout=SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SupervisorError(f"chunk sweep still running after {SWEEP_TIMEOUT_S:.0f}s") from None
    finally:
        child.terminate(grace_s=5.0)  # no-op once it has exited
    if code != 0:
        raise SupervisorError(f"chunk sweep {child.describe_exit()}:\n{child.log_tail()}")
    with open(out) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
