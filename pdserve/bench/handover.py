"""``pdserve bench handover``: what the prefill -> decode handover costs, as ratios from one run.

A disaggregated request's first token comes from prefill and its second from decode; the gap
between them is the handover as a user sees it. It is one decode step plus the KV pull plus
whatever the system adds (routing, admission, waiting for step boundaries, lease release):
that last part is the overhead this benchmark isolates. It runs four measurements in one
session, so that every ratio compares numbers taken under the same machine load:

1. **Concurrency 1.** A 1P1D cluster and a colocated engine (same router code, one decode
   engine, no prefill) take turns on the same prompts. Overhead = client-side gap between the
   first and second token - one decode step (the step that made the second token, from the
   request's timeline; the median of later gaps for builds without one, also reported) - the
   KV pull (from the timeline). TTFT of P/D is compared with colocated.
2. **Under load.** Poisson arrivals (default 0.5 req/s) on a 1P1D cluster set up as in
   ``bench serve`` (each engine pinned to its own core, one thread): the handover p50 against
   pull + 1.5 decode steps (a request landing mid-step waits half a step on average, then runs
   one).
3. **Pulls.** ``bench transfer``'s movers for a one-block and a 512-token pull, best transport
   against memcpy of the same bytes.
4. **Where the milliseconds go.** Every request's timeline (router, prefill, decode and
   transfer-thread events) is averaged into a per-stage breakdown, saved as a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.common import stats
from pdserve.config import KV_TRANSPORTS

# Stages of a handover, in order, as (label, from event, to event) over the timeline's events.
# Events are milliseconds since the router received the request (RequestMetrics.timeline_ms).
STAGES = [
    ("router -> prefill core", "router.receive", "prefill.received"),
    ("prefill queue", "prefill.received", "prefill.scheduled"),
    ("prefill compute", "prefill.scheduled", "prefill.first_token"),
    ("prefill -> router", "prefill.first_token", "router.prefill_answer"),
    ("router -> decode core", "router.prefill_answer", "decode.received"),
    ("decode admit", "decode.received", "decode.admitted"),
    ("pull queued", "decode.admitted", "decode.pull_start"),
    ("KV pull", "decode.pull_start", "decode.pull_end"),
    ("lease release", "decode.pull_end", "decode.released"),
    ("load noticed", "decode.released", "decode.load_done"),
    ("wait for step", "decode.load_done", "decode.scheduled"),
    ("first decode step", "decode.scheduled", "decode.first_token"),
    ("decode -> router", "decode.first_token", "router.decode_first_token"),
]


@dataclass
class RequestTrace:
    """What the client saw of one request, plus the router's timeline of it."""

    path: str  # "pd" or "colocated"
    sent: float
    token_times: list[float] = field(default_factory=list)  # one per token, perf_counter seconds
    timeline_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.sent) * 1e3

    @property
    def handover_ms(self) -> float:
        return (self.token_times[1] - self.token_times[0]) * 1e3

    @property
    def later_gaps_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1e3 for a, b in zip(t[1:], t[2:], strict=False)]

    @property
    def first_step_ms(self) -> float | None:
        """The decode step that produced this request's second token, from its timeline."""
        start, end = self.timeline_ms.get("decode.scheduled"), self.timeline_ms.get("decode.first_token")
        return None if start is None or end is None else end - start

    @property
    def pull_ms(self) -> float | None:
        start, end = self.timeline_ms.get("decode.pull_start"), self.timeline_ms.get("decode.pull_end")
        return None if start is None or end is None else end - start


def run_one(client: Any, path: str, prompt: list[int], max_tokens: int, request_id: str) -> RequestTrace:
    trace = RequestTrace(path=path, sent=time.perf_counter())
    try:
        for delta in client.stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id=request_id
        ):
            now = time.perf_counter()
            trace.token_times += [now] * len(delta.token_ids)
            if delta.finish_reason:
                trace.timeline_ms = dict(delta.metrics.get("timeline_ms") or {})
        if len(trace.token_times) < max_tokens:
            trace.error = f"got {len(trace.token_times)} of {max_tokens} tokens"
    except Exception as exc:  # a failed request is reported, not fatal to the run
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts: no prefix-cache hit makes one request cheaper than another."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def median_or_nan(values: list[float]) -> float:
    """``stats.median``, NaN for no values: the summary's arithmetic carries it into the JSON."""
    mid = stats.median(values)
    return math.nan if mid is None else mid


# ---------------------------------------------------------------------- the phases


def phase_concurrency_1(
    pd: Any, colocated: Any, prompts: list[list[int]], args: argparse.Namespace
) -> list[RequestTrace]:
    """P/D and colocated take turns, one request at a time (the first pair warms up)."""
    from tqdm import tqdm

    traces: list[RequestTrace] = []
    for i, prompt in enumerate(tqdm(prompts, desc="concurrency 1", unit="pair")):
        for path, client in (("pd", pd), ("colocated", colocated)):
            trace = run_one(client, path, prompt, args.output_tokens, f"c1-{path}-{i}")
            if i > 0:
                traces.append(trace)
    return traces


def phase_load(pd: Any, prompts: list[list[int]], args: argparse.Namespace) -> list[RequestTrace]:
    """Open loop: Poisson arrivals at ``--load-rate``; every request streams on its own thread."""
    from tqdm import tqdm

    rng = random.Random(args.seed + 1)
    traces: list[RequestTrace | None] = [None] * len(prompts)
    threads = []
    progress = tqdm(total=len(prompts), desc=f"load {args.load_rate} req/s", unit="req")

    def one(i: int) -> None:
        traces[i] = run_one(pd, "pd", prompts[i], args.load_output_tokens, f"load-{i}")
        progress.update(1)

    start = time.perf_counter()
    due = 0.0
    for i in range(len(prompts)):
        time.sleep(max(0.0, start + due - time.perf_counter()))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        due += rng.expovariate(args.load_rate)
    for thread in threads:
        thread.join()
    progress.close()
    return [t for t in traces if t is not None]


def phase_pulls(tokens: list[int], iters: int) -> list[dict[str, Any]]:
    """``bench transfer``'s movers (every installed transport and memcpy) at these sizes."""
    from pdserve.bench.transfer import (
        BUNDLED_SPEC,
        MemcpyFloor,
        TransportPair,
        make_plan,
        make_rows,
        measure,
    )
    from pdserve.connector.transports import available_transports

    spec = BUNDLED_SPEC
    plan = make_plan(sorted(tokens), iters, spec.bytes_per_block, spec.block_size)
    num_blocks = max(p.blocks for p in plan) + 8
    movers: dict[str, Any] = {"memcpy": MemcpyFloor(num_blocks, "contiguous")}
    errors: list[str] = []
    try:
        for name in available_transports():
            try:
                movers[name] = TransportPair(name, num_blocks, "contiguous", 30.0)
            except Exception as exc:
                errors.append(f"{name}: {exc}")
        samples = measure(movers, plan, 5, errors)
    finally:
        for mover in movers.values():
            mover.close()
    for error in errors:
        print(f"warning: {error}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for name, per_size in samples.items():
        rows += make_rows(name, plan, per_size, samples["memcpy"])
    return rows


# ---------------------------------------------------------------------- summary


def stage_breakdown(traces: list[RequestTrace]) -> list[dict[str, Any]]:
    """Median milliseconds of each stage over the requests whose timeline has both ends."""
    rows = []
    for label, start, end in STAGES:
        spans = [
            t.timeline_ms[end] - t.timeline_ms[start]
            for t in traces
            if start in t.timeline_ms and end in t.timeline_ms
        ]
        if spans:
            rows.append(
                {"stage": label, "from": start, "to": end, "p50_ms": median_or_nan(spans), "n": len(spans)}
            )
    return rows


def summarize(
    c1: list[RequestTrace],
    load: list[RequestTrace],
    pulls: list[dict[str, Any]],
    fallback_pull_ms: float | None,
    prompt_tokens: int = 512,
) -> dict[str, Any]:
    pd = [t for t in c1 if t.path == "pd" and t.error is None]
    colo = [t for t in c1 if t.path == "colocated" and t.error is None]
    out: dict[str, Any] = {"goals": []}
    if pd and colo:
        step = median_or_nan([g for t in pd for g in t.later_gaps_ms])
        gap = median_or_nan([t.handover_ms for t in pd])
        pull_samples = [t.pull_ms for t in pd if t.pull_ms is not None]
        pull = median_or_nan(pull_samples) if pull_samples else fallback_pull_ms or float("nan")
        # One decode step: the very step that made the second token when the timeline has it
        # (on a busy machine steps vary a lot), else the median of the later gaps.
        overhead = median_or_nan(
            [
                t.handover_ms
                - (t.first_step_ms if t.first_step_ms is not None else step)
                - (t.pull_ms if t.pull_ms is not None else pull)
                for t in pd
            ]
        )
        overhead_median_step = median_or_nan(
            [t.handover_ms - step - (t.pull_ms if t.pull_ms is not None else pull) for t in pd]
        )
        ttft_pd, ttft_colo = median_or_nan([t.ttft_ms for t in pd]), median_or_nan([t.ttft_ms for t in colo])
        out["concurrency_1"] = {
            "requests": len(pd),
            "handover_p50_ms": gap,
            "decode_step_p50_ms": step,
            "pull_p50_ms": pull,
            "pull_source": "timeline" if pull_samples else "transfer bench (no timeline from this build)",
            "overhead_p50_ms": overhead,
            "overhead_vs_median_step_p50_ms": overhead_median_step,
            "first_step_p50_ms": median_or_nan([t.first_step_ms for t in pd if t.first_step_ms is not None]),
            "ttft_pd_p50_ms": ttft_pd,
            "ttft_colocated_p50_ms": ttft_colo,
            "ttft_ratio": ttft_pd / ttft_colo,
        }
        out["goals"].append(_goal("handover overhead at concurrency 1 (ms, p50)", overhead, "<=", 10.0))
        out["goals"].append(_goal("TTFT 1P1D / colocated at concurrency 1", ttft_pd / ttft_colo, "<=", 1.05))
    done = [t for t in load if t.error is None and len(t.token_times) >= 3]
    if done:
        step = median_or_nan([g for t in done for g in t.later_gaps_ms])
        pull_samples = [t.pull_ms for t in done if t.pull_ms is not None]
        pull = median_or_nan(pull_samples) if pull_samples else fallback_pull_ms or float("nan")
        handover = median_or_nan([t.handover_ms for t in done])
        gaps = sorted(g for t in done for g in t.later_gaps_ms)
        out["load"] = {
            "requests": len(done),
            "failed": len(load) - len(done),
            "handover_p50_ms": handover,
            "decode_step_p50_ms": step,
            "pull_p50_ms": pull,
            "handover_in_steps": handover / step,
            # With --handover-step inflight: handovers whose request joined the step in flight.
            "joined_in_flight": sum(1 for t in done if "decode.joined_in_flight" in t.timeline_ms),
            # What the running requests pay for the handovers (a separate handover step delays
            # their next token once): inter-token gaps after the second token.
            "itl_mean_ms": statistics.fmean(gaps),
            "itl_p99_ms": stats.percentile(gaps, 99),
        }
        budget = pull + 1.5 * step
        out["goals"].append(
            _goal("handover under load / (pull + 1.5 decode steps), p50", handover / budget, "<=", 1.0)
        )
    moved = [r for r in pulls if r["transport"] != "memcpy"]
    for tokens, target in ((16, 0.5), (prompt_tokens, 0.8)):
        rows = [r for r in moved if r["tokens"] == tokens]
        if rows:
            best = max(rows, key=lambda r: r["ratio_to_memcpy"])
            out["goals"].append(
                _goal(
                    f"{tokens}-token pull vs memcpy, best transport ({best['transport']})",
                    best["ratio_to_memcpy"],
                    ">=",
                    target,
                )
            )
    return out


def _goal(name: str, value: float, op: str, target: float) -> dict[str, Any]:
    met = value <= target if op == "<=" else value >= target
    return {"goal": name, "measured": value, "target": f"{op} {target:g}", "met": bool(met)}


# The handover proper: from prefill's first token to decode's reaching the router, minus the
# decode step itself (which is what a colocated engine pays too).
HANDOVER_STAGES = [label for label, _, _ in STAGES[3:] if label != "first decode step"]


def plot(breakdown: list[dict[str, Any]], summary: dict[str, Any], path: str) -> None:
    """Two bars per phase: the whole request, and the handover alone (where overhead hides)."""
    import matplotlib

    from pdserve.bench.common.report import new_figure, save_figure

    phases = [("concurrency 1", breakdown), ("load", summary.get("stages_load", []))]
    phases = [(name, rows) for name, rows in phases if rows]
    fig, axes = new_figure(len(phases) or 1, 2, figsize=(13, 1.6 + 2.2 * max(len(phases), 1)), squeeze=False)
    color = {label: matplotlib.colormaps["tab20"](i % 20) for i, (label, _, _) in enumerate(STAGES)}
    for (name, rows), (whole, handover_only) in zip(phases, axes, strict=False):
        for ax, chosen in (
            (whole, rows),
            (handover_only, [r for r in rows if r["stage"] in HANDOVER_STAGES]),
        ):
            left = 0.0
            for row in chosen:
                width = max(row["p50_ms"], 0.0)
                ax.barh(
                    [0],
                    [width],
                    left=left,
                    color=color[row["stage"]],
                    label=f"{row['stage']} ({row['p50_ms']:.1f})",
                )
                left += width
            ax.set_yticks([])
        whole.set_title(f"{name}: whole request, median ms per stage", fontsize=9)
        handover_only.set_title(f"{name}: handover without the decode step ({left:.1f} ms)", fontsize=9)
        handover_only.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    c1 = summary.get("concurrency_1", {})
    fig.suptitle(
        f"1P1D handover at concurrency 1: gap {c1.get('handover_p50_ms', float('nan')):.1f} ms = decode step "
        f"{c1.get('first_step_p50_ms', c1.get('decode_step_p50_ms', float('nan'))):.1f} + pull "
        f"{c1.get('pull_p50_ms', float('nan')):.1f} + overhead {c1.get('overhead_p50_ms', float('nan')):.1f}",
        fontsize=10,
    )
    save_figure(fig, path)


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench handover", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=8, help="per request at concurrency 1")
    p.add_argument("--requests", type=int, default=12, help="timed pairs at concurrency 1 (plus one warm-up)")
    p.add_argument("--load-rate", type=float, default=0.5, help="req/s in the load phase (0 skips it)")
    p.add_argument("--load-requests", type=int, default=16)
    p.add_argument("--load-output-tokens", type=int, default=64)
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="load phase: don't pin prefill and decode to a core each (default: pinned, like bench serve)",
    )
    p.add_argument("--pull-iters", type=int, default=30, help="reads per size in the pull phase (0 skips it)")
    p.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS))
    p.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default: bench-results/handover.json")
    p.add_argument("--plot", default=None, help="default: bench-results/handover.png")
    return p


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench.common.report import default_path, print_table, save_json
    from pdserve.client import Client
    from pdserve.cluster import LocalCluster
    from pdserve.engine.model.loader import bundled_model_path

    args = build_parser().parse_args(argv)
    model = args.model or bundled_model_path()
    say = lambda message: print(message, flush=True)  # noqa: E731
    fallback_pull = None
    pulls: list[dict[str, Any]] = []
    if args.pull_iters > 0:
        say(f"pull phase: bench transfer movers at 16 and {args.prompt_tokens} tokens ...")
        pulls = phase_pulls([16, args.prompt_tokens], args.pull_iters)
        fallback_pull = min(
            (r["p50_ms"] for r in pulls if r["transport"] != "memcpy" and r["tokens"] == args.prompt_tokens),
            default=None,
        )

    engine_args = [a for arg in args.engine_arg for a in arg.split()]
    with contextlib.ExitStack() as stack:
        say("starting a 1P1D cluster and a colocated engine ...")
        pd_cluster = stack.enter_context(pd_cluster_for(args, model, engine_args, say))
        colo_cluster = stack.enter_context(LocalCluster(0, 1, model, engine_args=engine_args, progress=say))
        pd, colo = Client(pd_cluster.router_address), Client(colo_cluster.router_address)
        stack.callback(pd.close)
        stack.callback(colo.close)
        vocab = _vocab_size(pd)
        prompts = random_prompts(args.requests + 1 + args.load_requests, args.prompt_tokens, vocab, args.seed)
        c1 = phase_concurrency_1(pd, colo, prompts[: args.requests + 1], args)
    load: list[RequestTrace] = []
    if args.load_rate > 0:
        # As bench serve's pd setup: each engine pinned to its own core, one thread each.
        pinned = args.pin and len(os.sched_getaffinity(0)) >= 2
        cpus: dict[str, Sequence[int]] = {"prefill-0": [0], "decode-0": [1]} if pinned else {}
        env = {"OMP_NUM_THREADS": "1"} if pinned else {}
        say(f"starting a 1P1D cluster for the load phase ({'engines pinned' if pinned else 'unpinned'}) ...")
        with contextlib.ExitStack() as stack:
            load_cluster = stack.enter_context(pd_cluster_for(args, model, engine_args, say, cpus, env))
            client = Client(load_cluster.router_address)
            stack.callback(client.close)
            load = phase_load(client, prompts[args.requests + 1 :], args)

    summary = summarize(c1, load, pulls, fallback_pull, args.prompt_tokens)
    breakdown = stage_breakdown([t for t in c1 if t.path == "pd" and t.error is None])
    summary["stages_concurrency_1"] = breakdown
    summary["stages_load"] = stage_breakdown([t for t in load if t.error is None])
    summary["pulls"] = pulls
    summary["requests"] = [
        {
            "phase": phase,
            "path": t.path,
            "token_ms": [(at - t.sent) * 1e3 for at in t.token_times],
            "timeline_ms": t.timeline_ms,
            "error": t.error,
        }
        for phase, traces in (("concurrency_1", c1), ("load", load))
        for t in traces
    ]
    summary["errors"] = [f"{t.path}: {t.error}" for t in c1 + load if t.error]
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "plot")} | {"model": model}

    if breakdown:
        print_table(
            "Where a handover's milliseconds go (concurrency 1, p50 per stage)",
            breakdown,
            ["stage", "p50_ms", "n"],
        )
    for key in ("concurrency_1", "load"):
        if key in summary:
            print_table(key.replace("_", " "), [summary[key]], list(summary[key]))
    print_table("Goals (one run)", summary["goals"], ["goal", "measured", "target", "met"])
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)
    save_json(args.json or default_path("handover", "json"), summary)
    plot(breakdown, summary, args.plot or default_path("handover", "png"))
    return 1 if summary["errors"] else 0


def pd_cluster_for(
    args: argparse.Namespace,
    model: str,
    engine_args: list[str],
    say: Any,
    cpus: dict[str, Sequence[int]] | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """A 1P1D cluster whose router sends every prompt through prefill (the handover under test)."""
    from pdserve.cluster import LocalCluster

    return LocalCluster(
        1,
        1,
        model,
        kv_transport=args.kv_transport,
        engine_args=engine_args,
        router_args=["--disagg-min-tokens", "0"],
        cpus=cpus,
        env=env,
        progress=say,
    )


def _vocab_size(client: Any) -> int:
    """The model's vocabulary, from one engine's Info (prompts must be valid token ids)."""
    import grpc

    from pdserve.v1 import engine_pb2, engine_pb2_grpc

    address = next(s["address"] for s in client.stats())
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=10).vocab_size


if __name__ == "__main__":
    sys.exit(main())
