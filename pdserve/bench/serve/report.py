"""Statistics, tables and plots of ``pdserve bench serve`` (see ``pdserve.bench.serve.driver``).

A request's record and a (setup, rate, repeat) row are plain dicts with the keys below; the
JSON file holds them as they are, so the README's numbers can be recomputed from it. Over
repeats, ``spread_by_rate`` gives each key metric's min / median / max / mean / sd per (setup, rate),
and ``verdicts`` says where P/D beats (or loses to) the best colocated setup in every repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.bench.common.report import new_figure, plot_cdf, print_table, save_figure
from pdserve.bench.common.stats import SPREAD_STATS, median, percentile, spread

if TYPE_CHECKING:
    from pdserve.bench.serve.workload import RequestSpec

STAGES = ("queue", "prefill", "transfer", "decode")  # the P/D breakdown, in request order
# Every JSON row has these keys (None where a value does not apply, e.g. transfer for colocated).
ROW_KEYS = (
    "setup", "rate", "repeat", "num_requests", "completed", "failed", "duration_s",
    "req_per_s", "out_tok_per_s", "goodput_frac", "goodput_req_per_s",
    *(f"{m}_ms_{s}" for m in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")),
    *(f"{st}_ms_{s}" for st in STAGES for s in ("mean", "p50", "p99")),
)  # fmt: skip
REQUEST_KEYS = (
    "setup", "rate", "repeat", "index", "prompt_len", "output_len", "num_tokens", "error",
    "ttft_ms", "e2e_ms", "tpot_ms", "itl_p90_ms", "itl_max_ms", "meets_slo",
    *(f"{st}_ms" for st in STAGES),
)  # fmt: skip


@dataclass
class RequestResult:
    """What came back for one request: client times of its streamed messages, the router's metrics."""

    spec: RequestSpec
    sent: float = 0.0
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in message)
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(k for _, k in self.token_times)

    def ttft_ms(self) -> float | None:
        return (self.token_times[0][0] - self.sent) * 1e3 if self.token_times else None

    def e2e_ms(self) -> float | None:
        return (self.token_times[-1][0] - self.sent) * 1e3 if self.token_times else None

    def itls_ms(self) -> list[float]:
        """One gap per token after the first: a message of k tokens gives k gaps of 1/k each."""
        gaps = []
        for (before, _), (now, k) in zip(self.token_times, self.token_times[1:], strict=False):
            gaps += [(now - before) * 1e3 / k] * k
        return gaps


# ---------------------------------------------------------------------- statistics


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _stage_ms(result: RequestResult, setup: str) -> dict[str, float | None]:
    """The router's breakdown of one request (transfer and decode only for P/D)."""
    m = result.metrics
    if not m:
        return dict.fromkeys(STAGES)
    stages: dict[str, float | None] = {"queue": m["queue_ms"], "prefill": m["prefill_ms"]}
    if setup == "pd" and m.get("decode_ms"):
        # The router's decode_ms runs from the prefill's end, so it holds the transfer too.
        stages["transfer"] = m["transfer_ms"]
        stages["decode"] = max(0.0, m["decode_ms"] - m["transfer_ms"])
    else:
        stages["transfer"] = stages["decode"] = None
    return stages


def request_record(
    setup: str, rate: float, result: RequestResult, slo: argparse.Namespace, repeat: int = 0
) -> dict[str, Any]:
    ttft, e2e, itls = result.ttft_ms(), result.e2e_ms(), result.itls_ms()
    n = result.num_tokens
    ok = result.error is None and n > 0
    itl_p90, itl_max = percentile(itls, 90), (max(itls) if itls else None)
    itl_judged = (itl_max if slo.slo_itl_stat == "max" else itl_p90) or 0.0
    meets = ok and ttft <= slo.slo_ttft_ms and itl_judged <= slo.slo_itl_ms
    record = {
        "setup": setup,
        "rate": rate,
        "repeat": repeat,
        "index": result.spec.index,
        "prompt_len": len(result.spec.prompt_token_ids),
        "output_len": result.spec.output_len,
        "num_tokens": n,
        "error": result.error,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "tpot_ms": (e2e - ttft) / (n - 1) if ok and n > 1 and e2e is not None and ttft is not None else None,
        "itl_p90_ms": itl_p90,
        "itl_max_ms": itl_max,
        "meets_slo": bool(meets),
    }
    record.update({f"{st}_ms": v for st, v in _stage_ms(result, setup).items()})
    assert set(record) == set(REQUEST_KEYS), set(record) ^ set(REQUEST_KEYS)
    return record


def summarize(
    setup: str, rate: float, results: list[RequestResult], records: list[dict], repeat: int = 0
) -> dict[str, Any]:
    done = [r for r in results if r.error is None and r.num_tokens > 0]
    ends = [r.token_times[-1][0] for r in done]
    duration = (max(ends) - min(r.sent for r in results)) if done else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    good = sum(rec["meets_slo"] for rec in records)
    row: dict[str, Any] = {
        "setup": setup,
        "rate": rate,
        "repeat": repeat,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "req_per_s": per_s(len(done)),
        "out_tok_per_s": per_s(sum(r.num_tokens for r in done)),
        "goodput_frac": good / len(results) if results else None,
        "goodput_req_per_s": per_s(good),
    }
    samples = {
        "ttft": [rec["ttft_ms"] for rec in records if rec["ttft_ms"] is not None],
        "itl": [gap for r in done for gap in r.itls_ms()],
        "tpot": [rec["tpot_ms"] for rec in records if rec["tpot_ms"] is not None],
        "e2e": [rec["e2e_ms"] for rec in records if rec["e2e_ms"] is not None],
    }
    for metric, values in samples.items():
        row[f"{metric}_ms_mean"] = _mean(values)
        for q in (50, 90, 99):
            row[f"{metric}_ms_p{q}"] = percentile(values, q)
    for stage in STAGES:
        values = [rec[f"{stage}_ms"] for rec in records if rec[f"{stage}_ms"] is not None]
        row[f"{stage}_ms_mean"] = _mean(values)
        row[f"{stage}_ms_p50"] = percentile(values, 50)
        row[f"{stage}_ms_p99"] = percentile(values, 99)
    assert set(row) == set(ROW_KEYS), set(row) ^ set(ROW_KEYS)
    return row


# Key metrics summarised over repeats and judged in the verdicts: +1 higher is better, -1 lower.
KEY_METRICS = {
    "goodput_req_per_s": +1, "ttft_ms_p50": -1, "ttft_ms_p99": -1,
    "itl_ms_p50": -1, "itl_ms_p99": -1, "e2e_ms_p50": -1,
}  # fmt: skip


def spread_by_rate(rows: list[dict]) -> list[dict[str, Any]]:
    """Per (setup, rate): each key metric's ``stats.spread`` over the repeats (min / median / max
    / mean / sd, the sample standard deviation, 0 with one repeat); all None for a metric as soon
    as one repeat had no value for it."""
    groups: dict[tuple[str, float], list[dict]] = {}  # {(setup, rate): [row per repeat]}
    for row in rows:
        groups.setdefault((row["setup"], row["rate"]), []).append(row)
    out = []
    for (setup, rate), mine in groups.items():
        entry: dict[str, Any] = {"setup": setup, "rate": rate, "repeats": len(mine)}
        for metric in KEY_METRICS:
            values = [r[metric] for r in mine]
            spread_of = None if any(v is None for v in values) else spread(values)
            entry.update(
                {f"{metric}_{stat}": None if spread_of is None else spread_of[stat] for stat in SPREAD_STATS}
            )
        out.append(entry)
    return out


def verdicts(rows: list[dict], baselines: Sequence[str], candidate: str = "pd") -> list[dict[str, Any]]:
    """P/D against the best colocated setup, per rate and key metric, claimed only if it holds
    in every repeat.

    In each repeat the baseline is whichever of ``baselines`` did best *on that metric in that
    repeat* (the most favourable baseline, so a P/D win is not a win over a weak one). The
    verdict is ``"pd better"`` when P/D beats it in every repeat, ``"pd worse"`` when it loses
    in every repeat, and ``"no claim"`` when the repeats disagree, tie or lack a value.
    """
    by_key = {(r["setup"], r["rate"], r["repeat"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows if r["setup"] == candidate})
    out = []
    for rate in rates:
        repeats = sorted(rep for (setup, rt, rep) in by_key if setup == candidate and rt == rate)
        for metric, direction in KEY_METRICS.items():
            per_repeat = []
            for rep in repeats:
                base = [(by_key[(b, rate, rep)][metric], b) for b in baselines if (b, rate, rep) in by_key]
                base = [(v, b) for v, b in base if v is not None]
                if not base:
                    continue
                value, setup = (max if direction > 0 else min)(base)
                mine = by_key[(candidate, rate, rep)][metric]
                sign = 0 if mine is None or mine == value else (1 if (mine - value) * direction > 0 else -1)
                per_repeat.append({"repeat": rep, "pd": mine, "best_colocated": value,
                                   "best_colocated_setup": setup, "sign": sign})  # fmt: skip
            if not per_repeat:
                continue
            signs = {p["sign"] for p in per_repeat}
            if len(per_repeat) == len(repeats) and signs == {1}:
                verdict = f"{candidate} better"
            elif len(per_repeat) == len(repeats) and signs == {-1}:
                verdict = f"{candidate} worse"
            else:
                verdict = "no claim"
            ratios = [
                p["pd"] / p["best_colocated"]
                for p in per_repeat
                if p["pd"] is not None and p["best_colocated"]
            ]
            out.append(
                {
                    "rate": rate,
                    "metric": metric,
                    "better": "higher" if direction > 0 else "lower",
                    "verdict": verdict,
                    "pd_over_best_median": median(ratios),
                    "per_repeat": per_repeat,
                }
            )
    return out


# ---------------------------------------------------------------------- report


def print_report(rows: list[dict], args: argparse.Namespace) -> None:
    """Three tables: throughput and goodput; latency percentiles; the P/D breakdown."""
    # Rich wraps a table to 80 columns when it is not writing to a terminal (a log, the README).
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "120")
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms and ITL {args.slo_itl_stat} <= {args.slo_itl_ms:g} ms"
    # Grouped by setup and rate, repeats side by side (they ran interleaved).
    order = {setup: i for i, setup in enumerate(dict.fromkeys(r["setup"] for r in rows))}
    rows = sorted(rows, key=lambda r: (order[r["setup"]], r["rate"], r["repeat"]))
    many = any(r["repeat"] for r in rows)
    rep_column = ["rep"] if many else []
    throughput = {
        "setup": "setup", "rate\nreq/s": "rate", "req/s": "req_per_s", "out\ntok/s": "out_tok_per_s",
        "good\nreq/s": "goodput_req_per_s", "KV xfer\np50 ms": "transfer_ms_p50",
        "KV xfer\np99 ms": "transfer_ms_p99",
    }  # fmt: skip
    table = []
    for r in rows:
        cells = {column: r[key] for column, key in throughput.items()}
        cells["done"] = f"{r['completed']}/{r['num_requests']}"
        cells["meet\nSLO"] = None if r["goodput_frac"] is None else f"{r['goodput_frac']:.0%}"
        cells["rep"] = r["repeat"] + 1
        table.append(cells)
    columns = ["setup", "rate\nreq/s", *rep_column, "done", "req/s", "out\ntok/s", "meet\nSLO", "good\nreq/s",
               "KV xfer\np50 ms", "KV xfer\np99 ms"]  # fmt: skip
    print_table(f"Throughput and goodput (SLO: {slo})", table, columns)

    latency = {"setup": "setup", "rate\nreq/s": "rate"}
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL")):
        latency.update({f"{label}\np{q}": f"{metric}_ms_p{q}" for q in (50, 90, 99)})
    latency.update({"TPOT\np50": "tpot_ms_p50", "e2e\np50": "e2e_ms_p50", "e2e\np99": "e2e_ms_p99"})
    table = [{"rep": r["repeat"] + 1, **{column: r[key] for column, key in latency.items()}} for r in rows]
    columns = list(latency)
    print_table("Latency (ms, client clock)", table, [*columns[:2], *rep_column, *columns[2:]])

    pd_rows = [r for r in rows if r["setup"] == "pd"]
    if pd_rows:

        def cell(r: dict, stage: str) -> str:
            parts = [r[f"{stage}_ms_{s}"] for s in ("mean", "p50", "p99")]
            return " / ".join("-" if v is None else f"{v:.1f}" if v >= 1 else f"{v:.2f}" for v in parts)

        breakdown = [
            {"rate\nreq/s": r["rate"], "rep": r["repeat"] + 1, **{st: cell(r, st) for st in STAGES}}
            for r in pd_rows
        ]
        print_table(
            "P/D: where a request's time goes (router clock, ms: mean / p50 / p99)",
            breakdown,
            ["rate\nreq/s", *rep_column, *STAGES],
        )


def print_chunk_sweep(chunk: dict[str, Any]) -> None:
    """The budget ``colocated-chunked`` uses and, when it was measured, the sweep behind it."""
    sweep = chunk.get("sweep")
    if sweep:
        table = [
            {
                "step budget\n(tokens)": "none (whole prompt)" if r["tokens"] is None else r["tokens"],
                f"decode step\nbatch {sweep['batch']} (ms)": r["decode_step_ms"],
                "step with a\nchunk (ms)": r["mixed_step_ms"],
                "x decode\nstep": r["ratio"],
                "steps per\nprompt": r["steps_per_prefill"],
                f"{sweep['prompt_len']}-token\nprefill (ms)": r["prefill_ms"],
                "chosen": "<-" if r["tokens"] == chunk["tokens"] else "",
            }
            for r in sweep["rows"]
        ]
        print_table(
            f"Chunked prefill sweep (one core, {sweep['threads']} thread; batch {sweep['batch']} decoding at "
            f"{sweep['prompt_len']}-token contexts; median of {sweep['repeats']} rounds)",
            table,
            list(table[0]),
        )
    print(f"colocated-chunked: step budget {chunk['tokens']} tokens ({chunk['source']}: {chunk['reason']})")


def _spread_cell(entry: dict, metric: str) -> str:
    mid, lo, hi = (entry[f"{metric}_{s}"] for s in ("median", "min", "max"))
    if mid is None:
        return "-"
    fmt = (lambda v: f"{v:.3f}") if metric.startswith("goodput") else (lambda v: f"{v:.0f}")
    return fmt(mid) if entry["repeats"] == 1 else f"{fmt(lo)} / {fmt(mid)} / {fmt(hi)}"


def print_spread_and_verdicts(spreads: list[dict], claims: list[dict], repeats: int) -> None:
    """Min / median / max of the key metrics over repeats, then P/D's verdict per rate."""
    names = {"goodput_req_per_s": "goodput\nreq/s", "ttft_ms_p50": "TTFT p50\nms", "ttft_ms_p99": "TTFT p99\nms",
             "itl_ms_p50": "ITL p50\nms", "itl_ms_p99": "ITL p99\nms", "e2e_ms_p50": "e2e p50\nms"}  # fmt: skip
    if repeats > 1:
        table = [
            {
                "setup": e["setup"],
                "rate\nreq/s": e["rate"],
                **{names[m]: _spread_cell(e, m) for m in KEY_METRICS},
            }
            for e in sorted(spreads, key=lambda e: (e["rate"], e["setup"]))
        ]
        print_table(
            f"Over {repeats} repeats: min / median / max", table, ["setup", "rate\nreq/s", *names.values()]
        )
    if not claims:
        return
    by_rate: dict[float, dict[str, str]] = {}
    for claim in claims:
        ratio = claim["pd_over_best_median"]
        text = claim["verdict"] if ratio is None else f"{claim['verdict']} ({ratio:.2f}x)"
        by_rate.setdefault(claim["rate"], {"rate\nreq/s": claim["rate"]})[names[claim["metric"]]] = text
    held = "in every one of" if repeats > 1 else "in the single run of"
    print_table(
        f"P/D vs the best colocated setup per metric (claimed only if it holds {held} {repeats} "
        "repeat(s); ratio = P/D / best, median)",
        list(by_rate.values()),
        ["rate\nreq/s", *names.values()],
    )


def front_overhead(rows: list[dict]) -> list[dict]:
    """HTTP front vs gRPC front on the same processes and rate: p50 TTFT and ITL, and the
    difference (what the OpenAI API costs over gRPC). Empty unless both APIs ran."""
    by_key = {(r["setup"], r["rate"]): r for r in rows}
    out = []
    for (label, rate), http in by_key.items():
        if not label.endswith("/openai"):
            continue
        setup = label[: -len("/openai")]
        grpc = by_key.get((setup, rate))
        if grpc is None:
            continue
        row: dict[str, Any] = {"setup": setup, "rate": rate}
        for metric in ("ttft", "itl"):
            g, h = grpc[f"{metric}_ms_p50"], http[f"{metric}_ms_p50"]
            row[f"{metric}_ms_p50_grpc"], row[f"{metric}_ms_p50_http"] = g, h
            row[f"{metric}_ms_p50_added"] = None if g is None or h is None else h - g
        out.append(row)
    return out


def print_front_overhead(overhead: list[dict]) -> None:
    columns = {
        "setup": "setup", "rate\nreq/s": "rate",
        "TTFT p50\ngRPC": "ttft_ms_p50_grpc", "TTFT p50\nHTTP": "ttft_ms_p50_http", "TTFT\nadded": "ttft_ms_p50_added",
        "ITL p50\ngRPC": "itl_ms_p50_grpc", "ITL p50\nHTTP": "itl_ms_p50_http", "ITL\nadded": "itl_ms_p50_added",
    }  # fmt: skip
    table = [{column: r[key] for column, key in columns.items()} for r in overhead]
    print_table("OpenAI HTTP front vs gRPC front (ms, client clock, same processes)", table, list(columns))


def plot_all(rows: list[dict], samples: dict, rates: list[float], setups: list[str], plot_dir: str,
             args: argparse.Namespace) -> list[str]:  # fmt: skip
    """Latency CDFs per rate (one line per setup, every repeat's samples pooled), goodput vs rate
    (median over repeats, bars from min to max), and the P/D breakdown (mean over repeats)."""
    paths = []
    for metric, label, slo in (("ttft", "TTFT (ms)", args.slo_ttft_ms), ("itl", "inter-token latency (ms)",
                                                                         args.slo_itl_ms)):  # fmt: skip
        fig, axes = new_figure(1, len(rates), figsize=(4.2 * len(rates), 3.6), squeeze=False)
        for ax, rate in zip(axes[0], rates, strict=True):
            for setup in setups:
                plot_cdf(ax, samples.get((setup, rate, metric), []), label=setup)
            ax.axvline(slo, color="grey", linestyle=":", label="SLO")
            ax.set_xscale("log")
            ax.set_title(f"{rate:g} req/s")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "tokens"))
            ax.grid(alpha=0.3)
            ax.legend()
        path = os.path.join(plot_dir, f"serve_{metric}_cdf.png")
        save_figure(fig, path)
        paths.append(path)

    fig, (ax_rate, ax_frac) = new_figure(1, 2, figsize=(9, 3.6))
    for setup in setups:
        xs = sorted({r["rate"] for r in rows if r["setup"] == setup and np.isfinite(r["rate"])})
        for ax, key, scale in ((ax_rate, "goodput_req_per_s", 1.0), (ax_frac, "goodput_frac", 100.0)):
            per_rate = [
                [scale * (r[key] or 0.0) for r in rows if r["setup"] == setup and r["rate"] == x] for x in xs
            ]
            mid = np.array([median(v) for v in per_rate])
            low = mid - np.array([min(v) for v in per_rate])
            high = np.array([max(v) for v in per_rate]) - mid
            ax.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3, label=setup)
    finite = [r for r in rates if np.isfinite(r)]
    if finite:
        ax_rate.plot(finite, finite, color="grey", linestyle=":", label="offered")
    ax_rate.set_ylabel("goodput (req/s meeting the SLO)")
    ax_frac.set_ylabel("requests meeting the SLO (%)")
    ax_frac.set_ylim(0, 105)
    for ax in (ax_rate, ax_frac):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SLO: TTFT <= {args.slo_ttft_ms:g} ms, ITL {args.slo_itl_stat} <= {args.slo_itl_ms:g} ms")
    path = os.path.join(plot_dir, "serve_goodput.png")
    save_figure(fig, path)
    paths.append(path)

    pd_rates = sorted({r["rate"] for r in rows if r["setup"] == "pd"})
    if pd_rates:
        fig, ax = new_figure(figsize=(1.6 * len(pd_rates) + 3, 3.6))
        labels = [f"{rate:g}" for rate in pd_rates]
        bottom = np.zeros(len(pd_rates))
        for stage in STAGES:
            heights = np.array(
                [
                    np.mean(
                        [
                            r[f"{stage}_ms_mean"] or 0.0
                            for r in rows
                            if r["setup"] == "pd" and r["rate"] == rate
                        ]
                    )
                    for rate in pd_rates
                ]
            )
            ax.bar(labels, heights, bottom=bottom, label=stage)
            bottom += heights
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean time per request (ms)")
        ax.set_title("P/D: router queue, prefill, transfer, decode")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
        path = os.path.join(plot_dir, "serve_pd_breakdown.png")
        save_figure(fig, path)
        paths.append(path)
    return paths
