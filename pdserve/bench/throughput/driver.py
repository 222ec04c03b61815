"""``pdserve bench throughput``: offline throughput on a mixed workload, pdserve vs transformers.

Every request is known up front (an offline batch job). pdserve gets them all at once through
``pdserve.LLM`` (continuous batching over the paged cache); transformers runs them as
length-sorted, left-padded ``generate`` batches at the best batch size of a sweep (see
``static_batching``). Both decode greedily with EOS ignored, so they produce the same tokens;
the run checks that and reports how many requests agree. The headline is ``ratio``: pdserve's
output tokens/s over the best transformers output tokens/s, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from pdserve.bench.common.hf_reference import load_transformers_reference
from pdserve.bench.common.report import default_path, new_figure, print_table, save_figure, save_json
from pdserve.bench.throughput.static_batching import BatchSizeRun, StaticBatchRunner
from pdserve.bench.throughput.workload import (
    OfflineWorkload,
    build_workload,
    read_lengths,
    sharegpt_like_lengths,
)

if TYPE_CHECKING:
    from pdserve import LLM

BLOCK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench throughput", description=__doc__)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the lengths, the prompt ids and the sweep order"
    )
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument(
        "--lengths", default=None, help='JSONL of {"prompt_len": .., "output_len": ..} per request'
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument(
        "--sweep-seconds",
        type=float,
        default=60.0,
        help="time box per transformers batch size (at least one batch each); the best then finishes",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="pdserve: running requests at most")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="pdserve: tokens per step at most"
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="pdserve KV blocks (default: the whole workload fits)"
    )
    p.add_argument("--json", default=None, help="default: bench-results/throughput.json")
    p.add_argument("--plot", default=None, help="default: the JSON path with .png")
    p.add_argument("--save-outputs", action="store_true", help="put every request's token ids in the JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.engine.model.loader import bundled_model_path

    path = args.model or bundled_model_path()
    lengths, source = _lengths(args)
    llm = make_llm(path, lengths, args)
    workload = build_workload(lengths, llm.engine.vocab_size, args.seed, source)
    print(f"workload: {workload.summary()}")

    pdserve_result, pdserve_outputs = run_pdserve(llm, workload, args)
    del llm
    gc.collect()  # free pdserve's KV cache before transformers allocates its own
    hf_result, sweep, hf_outputs = run_transformers(path, workload, args)

    identical = [i for i in range(len(workload)) if pdserve_outputs[i] == hf_outputs[i]]
    ratio = pdserve_result["out_tok_per_s"] / hf_result["out_tok_per_s"]
    payload = {
        "ratio": ratio,
        "model": path,
        "threads": torch.get_num_threads(),
        "workload": workload.summary(),
        "pdserve": pdserve_result,
        "transformers": {**hf_result, "sweep": sweep},
        "outputs": {"compared": len(workload), "identical": len(identical)},
    }
    if args.save_outputs:
        payload["outputs"]["token_ids"] = [
            {"pdserve": pdserve_outputs[i], "transformers": hf_outputs[i]} for i in range(len(workload))
        ]
    _print_report(payload)
    json_path = args.json or default_path("throughput", "json")
    save_json(json_path, payload)
    plot(payload, workload, args.plot or os.path.splitext(json_path)[0] + ".png")
    return 0


def _lengths(args: argparse.Namespace) -> tuple[list[tuple[int, int]], str]:
    if args.lengths:
        return read_lengths(args.lengths)[: args.num_requests], args.lengths
    lengths = sharegpt_like_lengths(args.num_requests, args.seed, args.max_prompt_len, args.max_output_len)
    return lengths, f"lognormal(seed={args.seed})"


def make_llm(path: str, lengths: list[tuple[int, int]], args: argparse.Namespace) -> LLM:
    """A colocated engine sized for the workload: by default every request's KV fits at once.

    Prefix caching is off: the prompts are random, so it could only hit on the warm-up.
    """
    from pdserve import LLM

    totals = [p + o for p, o in lengths]
    num_blocks = args.num_blocks or sum(-(-n // BLOCK_SIZE) for n in totals) + 16
    return LLM(
        path,
        max_model_len=max(totals),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )


def run_pdserve(
    llm: LLM, workload: OfflineWorkload, args: argparse.Namespace
) -> tuple[dict, list[list[int]]]:
    """All requests submitted at once (one ``generate`` call), greedy, EOS ignored."""
    from pdserve.engine.request import SamplingParams

    llm.generate([workload.prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens]
    bar = tqdm(total=sum(workload.output_lens), desc="pdserve", unit="tok", disable=args.no_progress)
    engine_step = llm.engine.step

    def step_with_progress():  # same thread as generate(): no shared state to race on
        outputs = engine_step()
        bar.update(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    # A deliberate per-instance patch, undone in the finally below.
    llm.engine.step = step_with_progress  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        completions = llm.generate(workload.prompts, params)
        seconds = time.perf_counter() - start
    finally:
        del llm.engine.step  # back to the class's method
        bar.close()
    outputs = [c.token_ids for c in completions]
    assert [len(t) for t in outputs] == workload.output_lens, "pdserve stopped a request early"
    scheduler = llm.engine.scheduler
    assert not scheduler.has_requests() and scheduler.kv_cache_manager.usage == 0.0, "KV blocks leaked"
    config = scheduler.scheduler_config
    return {
        "seconds": seconds,
        **_rates(seconds, workload),
        "num_preemptions": scheduler.num_preemptions,
        "engine_args": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_blocks": scheduler.kv_cache_manager.block_pool.num_blocks,
            "block_size": BLOCK_SIZE,
            "enable_prefix_caching": False,
        },
    }, outputs


def run_transformers(
    path: str, workload: OfflineWorkload, args: argparse.Namespace
) -> tuple[dict, list[dict], list[list[int]]]:
    """The batch-size sweep, then the best size on the whole workload."""
    model = load_transformers_reference(path)
    runner = StaticBatchRunner(model, workload, args.seed)
    runner.generate([0])  # warm-up (its time and tokens are not counted)
    batch_sizes = sorted({min(b, len(workload)) for b in args.batch_sizes})
    runs: dict[int, BatchSizeRun] = {}
    for batch_size in batch_sizes:
        run = runner.new_run(batch_size)
        sweep_total = sum(workload.output_lens)
        with tqdm(
            total=sweep_total,
            desc=f"transformers batch {batch_size} (sweep)",
            unit="tok",
            disable=args.no_progress,
        ) as bar:
            runner.advance(run, budget_s=args.sweep_seconds, on_batch=bar.update)
        runs[batch_size] = run
    sweep = [run.row() for run in runs.values()]
    best = max(runs.values(), key=lambda run: run.output_tokens / run.seconds)
    with tqdm(
        total=sum(workload.output_lens),
        initial=best.output_tokens,
        desc=f"transformers batch {best.batch_size} (full)",
        unit="tok",
        disable=args.no_progress,
    ) as bar:
        runner.advance(best, budget_s=None, on_batch=bar.update)
    result = {"best_batch_size": best.batch_size, "seconds": best.seconds, **_rates(best.seconds, workload)}
    for row in sweep:  # rows are the sweep's measurements, taken before the best one finished
        row["chosen"] = row["batch_size"] == best.batch_size
    return result, sweep, [best.outputs[i] for i in range(len(workload))]


def _rates(seconds: float, workload: OfflineWorkload) -> dict:
    return {
        "req_per_s": len(workload) / seconds,
        "out_tok_per_s": sum(workload.output_lens) / seconds,
        "total_tok_per_s": (sum(workload.prompt_lens) + sum(workload.output_lens)) / seconds,
    }


def _print_report(payload: dict) -> None:
    pd, hf = payload["pdserve"], payload["transformers"]
    num_requests = payload["workload"]["num_requests"]

    def row(engine: str, batch: object, requests: int, result: dict) -> dict:
        return {
            "engine": engine,
            "batch": batch,
            "reqs": requests,
            "seconds": result["seconds"],
            "req/s": result["req_per_s"],
            "out tok/s": result["out_tok_per_s"],
            "x best HF": result["out_tok_per_s"] / hf["out_tok_per_s"],
        }

    rows = [row("pdserve", f"<={pd['engine_args']['max_num_seqs']}", num_requests, pd)]
    for sweep in hf["sweep"]:
        done = "all" if sweep["complete"] else f"{sweep['batches_run']}/{sweep['num_batches']}"
        rows.append(row(f"HF sweep ({done})", sweep["batch_size"], sweep["requests"], sweep))
    rows.append(row("HF best, full", hf["best_batch_size"], num_requests, hf))
    print_table("offline throughput, same run (fp32, CPU)", rows, list(rows[0]))
    out = payload["outputs"]
    print(
        f"ratio (pdserve / best transformers output tok/s): {payload['ratio']:.2f}x; "
        f"greedy outputs identical for {out['identical']}/{out['compared']} requests"
    )


def plot(payload: dict, workload: OfflineWorkload, path: str) -> None:
    fig, (bars, hist) = new_figure(1, 2, figsize=(11, 4))
    sweep = payload["transformers"]["sweep"]
    labels = [f"HF b={row['batch_size']}" + ("" if row["complete"] else "*") for row in sweep]
    values = [row["out_tok_per_s"] for row in sweep]
    labels += [f"HF best b={payload['transformers']['best_batch_size']}", "pdserve"]
    values += [payload["transformers"]["out_tok_per_s"], payload["pdserve"]["out_tok_per_s"]]
    colors = ["tab:orange"] * (len(values) - 1) + ["tab:blue"]
    bars.bar(range(len(values)), values, color=colors)
    bars.set_xticks(range(len(values)), labels, rotation=30, ha="right")
    bars.set_ylabel("output tokens/s")
    bars.set_title(f"pdserve = {payload['ratio']:.2f}x best transformers (* = sampled batches)")
    top = max(workload.prompt_lens + workload.output_lens)
    bins = list(range(0, top + 33, 32))
    hist.hist(workload.prompt_lens, bins=bins, alpha=0.6, label="prompt")
    hist.hist(workload.output_lens, bins=bins, alpha=0.6, label="output")
    hist.set_xlabel("tokens")
    hist.set_ylabel("requests")
    hist.set_title(f"workload: {len(workload)} requests, {workload.source}")
    hist.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
