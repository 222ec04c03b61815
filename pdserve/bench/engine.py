"""``pdserve bench engine``: pdserve's colocated engine vs transformers, side by side in one run.

Measures prefill tokens/s for one long prompt, decode tokens/s at several batch sizes (same
prompts, same number of generated tokens, greedy, for both), and the scheduler's own cost per
step with many running decodes as a fraction of one real decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from pdserve.bench.common.hf_reference import load_transformers_reference
from pdserve.bench.common.report import default_path, new_figure, print_table, save_figure, save_json


def _time(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the first ids (special tokens) so no prompt contains EOS.
    return torch.randint(100, vocab, (batch, length), generator=generator).tolist()


def scheduler_cost_us(num_reqs: int, steps: int = 50) -> float:
    """Microseconds per ``schedule()`` + ``update_from_output()`` with ``num_reqs`` decoding."""
    from pdserve.config import CacheConfig, SchedulerConfig
    from pdserve.engine.outputs import ModelRunnerOutput
    from pdserve.engine.request import Request, SamplingParams
    from pdserve.engine.scheduler import Scheduler

    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_reqs, max_model_len=4096),
        CacheConfig(block_size=16, num_blocks=num_reqs * 8),
    )
    for i in range(num_reqs):
        scheduler.add_request(
            Request(f"r{i}", [100 + i] * 32, SamplingParams(max_tokens=10_000, ignore_eos=True))
        )

    def step() -> None:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        scheduler.update_from_output(
            out, ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, [[7]] * len(ids))
        )

    step()  # the prefill step; every later step is a pure decode step
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    scheduler.finish_requests([f"r{i}" for i in range(num_reqs)])
    return elapsed / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2-135M)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--scheduler-reqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)

    from pdserve import LLM
    from pdserve.engine.model.loader import bundled_model_path
    from pdserve.engine.request import SamplingParams

    path = args.model or bundled_model_path()
    print(f"loading {path} (pdserve and transformers, fp32) ...")
    llm = LLM(path, max_model_len=4096, num_blocks=2048, enable_prefix_caching=False, max_num_seqs=256)
    hf = load_transformers_reference(path)
    vocab = llm.engine.vocab_size
    rows: list[dict] = []
    phases = tqdm(total=1 + len(args.batch_sizes) + 1, desc="bench engine", unit="phase")

    # Prefill: one long prompt, first token only.
    prompt = _random_prompts(1, args.prefill_tokens, vocab, seed=0)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    pd_s = _time(lambda: llm.generate(prompt, one_token), args.repeats)
    with torch.inference_mode():
        ids = torch.tensor(prompt)
        hf_s = _time(lambda: hf(ids, use_cache=True), args.repeats)
    rows.append(_row("prefill", 1, args.prefill_tokens / pd_s, args.prefill_tokens / hf_s))
    phases.update()

    # Decode: batch B, same prompts and lengths for both engines.
    decode_step_s: dict[int, float] = {}
    for batch in args.batch_sizes:
        prompts = _random_prompts(batch, args.decode_prompt_tokens, vocab, seed=batch)
        params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
        pd_s = _time(lambda p=prompts, sp=params: llm.generate(p, sp), args.repeats)
        input_ids = torch.tensor(prompts)
        with torch.inference_mode():
            hf_s = _time(
                lambda x=input_ids: hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.decode_tokens,
                    min_new_tokens=args.decode_tokens,
                    do_sample=False,
                    pad_token_id=0,
                ),
                args.repeats,
            )
        tokens = batch * args.decode_tokens
        rows.append(_row("decode", batch, tokens / pd_s, tokens / hf_s))
        decode_step_s[batch] = pd_s / args.decode_tokens
        phases.update()

    sched_us = scheduler_cost_us(args.scheduler_reqs)
    ref_batch = max(decode_step_s)
    step_us = decode_step_s[ref_batch] * 1e6
    phases.update()
    phases.close()

    print_table(
        "pdserve vs transformers (fp32, CPU, same run)",
        rows,
        ["phase", "batch", "pdserve_tok_s", "transformers_tok_s", "ratio"],
    )
    print(
        f"scheduler: {sched_us:.0f} us per schedule()+update_from_output() with "
        f"{args.scheduler_reqs} running decodes = {sched_us / step_us:.2%} of one decode step "
        f"at batch {ref_batch} ({step_us / 1000:.1f} ms)"
    )
    payload = {
        "model": path,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "scheduler": {
            "num_running_reqs": args.scheduler_reqs,
            "us_per_step": sched_us,
            "decode_step_us": step_us,
            "decode_step_batch": ref_batch,
            "fraction_of_decode_step": sched_us / step_us,
        },
    }
    save_json(args.json or default_path("engine", "json"), payload)
    _plot(rows, args.plot or default_path("engine", "png"))
    return 0


def _row(phase: str, batch: int, pdserve_tok_s: float, hf_tok_s: float) -> dict:
    return {
        "phase": phase,
        "batch": batch,
        "pdserve_tok_s": pdserve_tok_s,
        "transformers_tok_s": hf_tok_s,
        "ratio": pdserve_tok_s / hf_tok_s,
    }


def _plot(rows: list[dict], path: str) -> None:
    fig, ax = new_figure(figsize=(7, 4))
    labels = [f"{r['phase']}\nbatch {r['batch']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pdserve_tok_s"] for r in rows], width=0.4, label="pdserve")
    ax.bar([x + 0.2 for x in xs], [r["transformers_tok_s"] for r in rows], width=0.4, label="transformers")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.set_title("pdserve vs transformers, same run (fp32, CPU)")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
