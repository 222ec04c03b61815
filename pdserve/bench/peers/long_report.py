"""What ``pdserve bench peers --scenario long`` makes of its two clients' detailed result files:
which requests met the SLO, the goodput, the gap and TTFT percentiles, the ratio to vLLM, the
tables and the plot.

Each client's result file (``vllm bench serve --save-result --save-detailed``) lists, per
request in the order sent: ``start_times`` (seconds of ``time.perf_counter``, the machine's
monotonic clock, so the two clients' times compare), ``ttfts`` (seconds, 0 when it failed),
``itls`` (seconds between consecutive streamed chunks after the first), ``latencies``,
``input_lens``, ``output_lens`` and ``errors`` ("" when it succeeded).

Kept apart from the scenario's driver (``pdserve.bench.peers.long_scenario``) so the arithmetic is
testable on result files without a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.common.stats import percentile
from pdserve.bench.peers.report import fmt_cell, print_rich_table, print_row_warnings, spread_cell

LOAD = "long"  # the rows' load name: one run of both clients per setup and repeat
STREAM, LONG = "stream", "long"  # the two clients' requests
RATIOS = {"goodput_vs_vllm": "goodput_req_per_s"}  # {ratio key: row metric}, each setup / vLLM
LLAMACPP_RATIOS = {"goodput_vs_llamacpp": "goodput_req_per_s"}  # each setup / llama.cpp
SPREAD_METRICS = (
    "goodput_req_per_s", "slo_fraction", "stream_itl_ms_p50", "stream_itl_ms_p99",
    "stream_max_gap_ms_p50", "stream_max_gap_ms_p90", "long_ttft_ms_p50", "out_tok_per_s",
    *RATIOS, *LLAMACPP_RATIOS,
)  # fmt: skip


@dataclass(frozen=True)
class Slo:
    """What a request must meet to count in the goodput."""

    itl_ms: float  # the longest gap between two streamed chunks, of a stream and of a long prompt
    ttft_ms: float  # a stream's time to first token
    long_ttft_ms: float  # a long prompt's time to first token


@dataclass(frozen=True)
class RequestTiming:
    """One request of a detailed result file. Times in seconds of the shared monotonic clock,
    gaps and TTFT in ms."""

    kind: str  # STREAM or LONG
    start_s: float
    ttft_ms: float
    gaps_ms: tuple[float, ...]  # between consecutive chunks after the first
    latency_s: float
    input_tokens: int
    output_tokens: int
    ok: bool

    @property
    def max_gap_ms(self) -> float:
        return max(self.gaps_ms, default=0.0)

    @property
    def first_token_s(self) -> float:
        return self.start_s + self.ttft_ms / 1000.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s

    def misses_ttft(self, slo: Slo) -> bool:
        return self.ttft_ms > (slo.ttft_ms if self.kind == STREAM else slo.long_ttft_ms)

    def misses_gap(self, slo: Slo) -> bool:
        return self.max_gap_ms > slo.itl_ms

    def meets(self, slo: Slo) -> bool:
        return self.ok and not self.misses_ttft(slo) and not self.misses_gap(slo)


def requests(result: dict[str, Any], kind: str) -> list[RequestTiming]:
    """Every request of one client's detailed result file."""
    columns = ("start_times", "ttfts", "itls", "latencies", "input_lens", "output_lens", "errors")
    missing = [c for c in columns if c not in result]
    if missing:
        raise ValueError(f"the result file has no {missing}: was the client run with --save-detailed?")
    out = []
    for start, ttft, itls, latency, input_len, output_len, error in zip(
        *(result[c] for c in columns), strict=True
    ):
        ok = not error and ttft > 0
        out.append(RequestTiming(kind, float(start), 1000.0 * ttft, tuple(1000.0 * g for g in itls),
                                 float(latency), int(input_len), int(output_len or 0), ok))  # fmt: skip
    return out


def long_row(
    streams: dict[str, Any], longs: dict[str, Any], slo: Slo, setup: str, repeat: int
) -> dict[str, Any]:
    """One setup's run: the streams client's and the long-prompt client's result files.

    The run lasts from the first request sent (either client) to the last one finished; the
    goodput is the requests meeting ``slo`` per second of it. A long prompt lands among the
    streams when it is sent while at least one stream is between its first and last token."""
    stream_reqs, long_reqs = requests(streams, STREAM), requests(longs, LONG)
    every = stream_reqs + long_reqs
    ok = [r for r in every if r.ok]
    duration_s = max(r.end_s for r in ok) - min(r.start_s for r in every) if ok else None
    met_streams = sum(r.meets(slo) for r in stream_reqs)
    met_long = sum(r.meets(slo) for r in long_reqs)
    stream_ok = [r for r in stream_reqs if r.ok]
    long_ok = [r for r in long_reqs if r.ok]
    gaps = [g for r in stream_ok for g in r.gaps_ms]
    max_gaps = sorted(r.max_gap_ms for r in stream_ok)
    long_ttfts = sorted(r.ttft_ms for r in long_ok)
    among = sum(any(s.first_token_s <= r.start_s < s.end_s for s in stream_ok) for r in long_reqs)
    errors = [e for e in [*streams["errors"], *longs["errors"]] if e]
    return {
        "setup": setup,
        "repeat": repeat,
        "load": LOAD,
        "streams_done": len(stream_ok),
        "streams_failed": len(stream_reqs) - len(stream_ok),
        "long_done": len(long_ok),
        "long_failed": len(long_reqs) - len(long_ok),
        "failed": len(every) - len(ok),
        "streams_met": met_streams,
        "long_met": met_long,
        "requests": len(every),
        "slo_fraction": (met_streams + met_long) / len(every) if every else None,
        "duration_s": duration_s,
        "goodput_req_per_s": (met_streams + met_long) / duration_s if duration_s else None,
        "out_tok_per_s": sum(r.output_tokens for r in ok) / duration_s if duration_s else None,
        # why the completed ones missed (both, for some): {kind}_missed_{gap, ttft}
        **{
            f"{kind}_missed_{why}": sum(getattr(r, f"misses_{why}")(slo) for r in done)
            for kind, done in (("streams", stream_ok), ("long", long_ok))
            for why in ("gap", "ttft")
        },  # fmt: skip
        "stream_ttft_ms_p50": percentile([r.ttft_ms for r in stream_ok], 50),
        "stream_ttft_ms_p90": percentile([r.ttft_ms for r in stream_ok], 90),
        "stream_itl_ms_p50": percentile(gaps, 50),
        "stream_itl_ms_p99": percentile(gaps, 99),
        "stream_max_gap_ms_p50": percentile(max_gaps, 50),
        "stream_max_gap_ms_p90": percentile(max_gaps, 90),
        "long_ttft_ms_p50": percentile(long_ttfts, 50),
        "long_ttft_ms_max": long_ttfts[-1] if long_ttfts else None,
        "long_max_gap_ms_p50": percentile([r.max_gap_ms for r in long_ok], 50),
        "long_input_tokens": [r.input_tokens for r in long_reqs],
        "long_among_streams": among,
        "first_long_after_s": (
            min(r.start_s for r in long_reqs) - min(r.start_s for r in stream_reqs)
            if long_reqs and stream_reqs
            else None
        ),
        "stream_max_gaps_ms": max_gaps,  # every stream's longest gap: the plot's CDF
        "long_ttfts_ms": long_ttfts,
        "error": errors[0][:300] if errors else None,
    }


def failed_long_row(setup: str, repeat: int, num_requests: int, error: str) -> dict[str, Any]:
    """The row of a run where a client produced no result file: no goodput (an error, not a zero)."""
    return {"setup": setup, "repeat": repeat, "load": LOAD, "requests": num_requests,
            "failed": num_requests, "streams_met": 0, "long_met": 0, "slo_fraction": None,
            "goodput_req_per_s": None, "stream_max_gaps_ms": [], "long_ttfts_ms": [],
            "error": error[:300]}  # fmt: skip


# ---------------------------------------------------------------------- terminal


TABLE_COLUMNS = {  # {title: row key}; times in ms
    "setup": "setup",
    "met": "met",
    "failed": "failed",
    "missed gap/TTFT": "missed",
    "SLO %": "slo_fraction",
    "goodput/s": "goodput_req_per_s",
    "÷ vLLM": "goodput_vs_vllm",
    "÷ llama.cpp": "goodput_vs_llamacpp",
    "TTFT p50/p90": "stream_ttft",
    "ITL p50": "stream_itl_ms_p50",
    "ITL p99": "stream_itl_ms_p99",
    "gap p50": "stream_max_gap_ms_p50",
    "gap p90": "stream_max_gap_ms_p90",
    "long TTFT p50": "long_ttft_ms_p50",
    "tok/s": "out_tok_per_s",
    "long in streams": "long_among_streams",
    "other cores": "other_cores",
}
LEGEND = (
    "met: streams + long prompts meeting the SLO / requests; missed gap/TTFT: streams missing the gap SLO, "
    "the TTFT SLO (some both), then long prompts; goodput/s: requests meeting the SLO per second of the "
    "run; TTFT, ITL: the streams'; gap: a stream's longest inter-token gap; long in streams: long "
    "prompts sent while a stream was decoding; times in ms"
)


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "met":
        return f"{row['streams_met']}+{row['long_met']}/{row['requests']}"
    if key == "missed":
        if row.get("streams_missed_gap") is None:
            return "-"
        return (f"{row['streams_missed_gap']}/{row['streams_missed_ttft']} "
                f"{row['long_missed_gap']}/{row['long_missed_ttft']}")  # fmt: skip
    if key == "stream_ttft":
        return f"{fmt_cell(row.get('stream_ttft_ms_p50'))}/{fmt_cell(row.get('stream_ttft_ms_p90'))}"
    if key == "slo_fraction" and row.get(key) is not None:
        return f"{row[key]:.0%}"
    if key == "long_among_streams" and row.get(key) is not None:
        return f"{row[key]}/{len(row['long_input_tokens'])}"
    return fmt_cell(row.get(key))


def print_long_tables(rows: Sequence[dict[str, Any]], spreads: Sequence[dict[str, Any]], machine_line: str,
                      slo: Slo) -> None:  # fmt: skip
    """One table per repeat, then the spread over the repeats."""
    repeats = sorted({r["repeat"] for r in rows})
    where = (f"SLO: stream TTFT <= {slo.ttft_ms:g} ms, long TTFT <= {slo.long_ttft_ms:g} ms, "
             f"every gap <= {slo.itl_ms:g} ms")  # fmt: skip
    for repeat in repeats:
        body = [[_cell(r, key) for key in TABLE_COLUMNS.values()] for r in rows if r["repeat"] == repeat]
        title = f"long prompts among streams, repeat {repeat + 1}/{len(repeats)} — {machine_line}\n{where}"
        print_rich_table(title, list(TABLE_COLUMNS), body, min_width=190)
    print(f"  {LEGEND}")
    print_row_warnings(rows, lambda row: f"{row['setup']} repeat {row['repeat'] + 1}")
    metrics = {"goodput/s": "goodput_req_per_s", "SLO fraction": "slo_fraction",
               "goodput ÷ vLLM": "goodput_vs_vllm", "goodput ÷ llama.cpp": "goodput_vs_llamacpp",
               "ITL p99": "stream_itl_ms_p99",
               "max gap p50": "stream_max_gap_ms_p50", "max gap p90": "stream_max_gap_ms_p90",
               "long TTFT p50": "long_ttft_ms_p50", "out tok/s": "out_tok_per_s"}  # fmt: skip
    body = [[e["setup"], *(spread_cell(e, m) for m in metrics.values())] for e in spreads]
    title = f"long prompts among streams, spread over {len(repeats)} repeat(s): median [min, max]"
    print_rich_table(title, ["setup", *metrics], body, min_width=220)


# ---------------------------------------------------------------------- plot


def plot_long(rows: Sequence[dict[str, Any]], spreads: Sequence[dict[str, Any]], setups: Sequence[str],
              slo: Slo, path: str) -> None:  # fmt: skip
    """The CDF of each stream's longest gap (left) and of the long prompts' TTFT (middle), one
    line per setup and repeat, the SLO dashed; the goodput per setup (right, median and the
    min-max bar over repeats, with the fraction of requests meeting the SLO)."""
    from pdserve.bench.common.report import new_figure, plot_cdf, save_figure

    fig, (gap_ax, ttft_ax, goodput_ax) = new_figure(1, 3, figsize=(17, 5))
    colors = {setup: f"C{i}" for i, setup in enumerate(setups)}
    styles = ("-", "--", ":", "-.")
    for row in rows:
        style = {"color": colors.get(row["setup"], "k"), "linestyle": styles[row["repeat"] % len(styles)],
                 "label": f"{row['setup']} r{row['repeat'] + 1}"}  # fmt: skip
        if row.get("stream_max_gaps_ms"):
            plot_cdf(gap_ax, row["stream_max_gaps_ms"], **style)
        if row.get("long_ttfts_ms"):
            plot_cdf(ttft_ax, row["long_ttfts_ms"], **style)
    for ax, limit, what in ((gap_ax, slo.itl_ms, "stream's longest inter-token gap (ms)"),
                            (ttft_ax, slo.long_ttft_ms, "long prompt's TTFT (ms)")):  # fmt: skip
        ax.axvline(limit, color="k", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    gap_ax.set_title("streams: longest gap (CDF)")
    ttft_ax.set_title("long prompts: TTFT (CDF)")
    by_setup = {e["setup"]: e for e in spreads}
    shown = [s for s in setups if s in by_setup and by_setup[s]["goodput_req_per_s_median"] is not None]
    mids = [by_setup[s]["goodput_req_per_s_median"] for s in shown]
    lows = [m - by_setup[s]["goodput_req_per_s_min"] for s, m in zip(shown, mids, strict=True)]
    highs = [by_setup[s]["goodput_req_per_s_max"] - m for s, m in zip(shown, mids, strict=True)]
    goodput_ax.bar(shown, mids, yerr=[lows, highs], capsize=4, color=[colors[s] for s in shown])
    for i, setup in enumerate(shown):
        fraction = by_setup[setup]["slo_fraction_median"]
        if fraction is not None and math.isfinite(fraction):
            goodput_ax.annotate(f"{fraction:.0%} met", (i, mids[i]), ha="center", va="bottom", fontsize=8,
                                xytext=(0, 4), textcoords="offset points")  # fmt: skip
    goodput_ax.set_ylabel("requests meeting the SLO per second")
    goodput_ax.set_title("goodput: median over repeats, bar min to max")
    goodput_ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
