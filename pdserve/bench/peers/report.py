"""What ``pdserve bench peers`` makes of ``vllm bench serve``'s result files: one row per setup,
load point and repeat, each setup's ratios to vLLM and to llama.cpp in the same repeat, the spread
over repeats, the tables and the plot.

Kept apart from the driver (``pdserve.bench.peers.driver``) so the arithmetic is testable on a result
file without starting a server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.common.stats import spread

BASELINE = "vllm"
# {row key: key of `vllm bench serve --save-result` JSON}; the p90 keys exist because the client
# is run with --metric-percentiles 50,90,99 (its median_* keys are there whatever it is given).
RESULT_KEYS = {
    "completed": "completed",
    "failed": "failed",
    "duration_s": "duration",
    "ttft_ms_p50": "median_ttft_ms",
    "ttft_ms_p90": "p90_ttft_ms",
    "ttft_ms_p99": "p99_ttft_ms",
    "itl_ms_p50": "median_itl_ms",
    "itl_ms_p90": "p90_itl_ms",
    "itl_ms_p99": "p99_itl_ms",
    "tpot_ms_p50": "median_tpot_ms",
    "e2el_ms_p50": "median_e2el_ms",
    "out_tok_per_s": "output_throughput",
    "out_tokens": "total_output_tokens",
    "req_per_s": "request_throughput",
    "max_concurrent_requests": "max_concurrent_requests",
}
ROW_KEYS = ("setup", "repeat", "load", "max_concurrency", "request_rate", "num_prompts",
            *RESULT_KEYS, "error")  # fmt: skip
LLAMACPP = "llamacpp"  # the second baseline: llama.cpp's llama-server on the GGUF itself
# {ratio key: row metric}; each is setup / vLLM (tok/s: above 1 is faster; ITL, TTFT: below 1).
RATIOS = {
    "tok_s_vs_vllm": "out_tok_per_s",
    "itl_vs_vllm": "itl_ms_p50",
    "ttft_vs_vllm": "ttft_ms_p50",
}
# The same against llama.cpp; ITL at one stream is the number pdserve's decode step is judged by.
LLAMACPP_RATIOS = {key.replace("_vs_vllm", "_vs_llamacpp"): metric for key, metric in RATIOS.items()}
# A run during which work not ours kept more cores than this busy on average is flagged.
BUSY_ELSEWHERE_CORES = 0.25
SPREAD_METRICS = ("ttft_ms_p50", "itl_ms_p50", "tpot_ms_p50", "out_tok_per_s", *RATIOS, *LLAMACPP_RATIOS)
_COUNTS = ("completed", "failed", "max_concurrent_requests", "out_tokens")  # kept as the client's integers


@dataclass(frozen=True)
class LoadPoint:
    """One ``vllm bench serve`` run's load: a closed loop of ``max_concurrency`` streams, or an
    open loop at ``request_rate`` req/s (Poisson arrivals, no concurrency cap)."""

    name: str  # "c1", "c8", "r2", ...
    num_prompts: int
    max_concurrency: int | None = None
    request_rate: float | None = None

    @staticmethod
    def closed(streams: int, num_prompts: int) -> LoadPoint:
        return LoadPoint(f"c{streams}", num_prompts, max_concurrency=streams)

    @staticmethod
    def open(rate: float, num_prompts: int) -> LoadPoint:
        return LoadPoint(f"r{rate:g}", num_prompts, request_rate=rate)

    def client_args(self) -> list[str]:
        argv = ["--num-prompts", str(self.num_prompts)]
        if self.max_concurrency is not None:
            argv += ["--max-concurrency", str(self.max_concurrency)]
        if self.request_rate is not None:
            argv += ["--request-rate", f"{self.request_rate:g}"]
        return argv


def row_head(setup: str, repeat: int, load: LoadPoint) -> dict[str, Any]:
    """What every row of a client run starts with: which setup, repeat and load it measured."""
    return {
        "setup": setup,
        "repeat": repeat,
        "load": load.name,
        "max_concurrency": load.max_concurrency,
        "request_rate": load.request_rate,
        "num_prompts": load.num_prompts,
    }


def parse_result(result: dict[str, Any], setup: str, repeat: int, load: LoadPoint) -> dict[str, Any]:
    """One row from a ``vllm bench serve`` result JSON (a metric it lacks is None)."""
    row = row_head(setup, repeat, load)
    for key, source in RESULT_KEYS.items():
        value = result.get(source)
        row[key] = float(value) if isinstance(value, int | float) and key not in _COUNTS else value
    errors = [e for e in result.get("errors") or [] if e]
    row["error"] = errors[0][:300] if errors else None
    if not row["completed"]:  # the client reports zeros, not latencies, when nothing finished
        for key in RESULT_KEYS:
            if key not in _COUNTS and key != "duration_s":
                row[key] = None
    return row


def failed_row(setup: str, repeat: int, load: LoadPoint, error: str) -> dict[str, Any]:
    """The row of a client run that produced no result file."""
    row: dict[str, Any] = {key: None for key in ROW_KEYS}
    row.update(setup=setup, repeat=repeat, load=load.name, max_concurrency=load.max_concurrency,
               request_rate=load.request_rate, num_prompts=load.num_prompts, completed=0,
               failed=load.num_prompts, error=error[:300])  # fmt: skip
    return row


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def add_ratios(
    rows: list[dict[str, Any]], baseline: str = BASELINE, ratios_of: dict[str, str] = RATIOS
) -> list[dict[str, Any]]:
    """Each row with its ratios (``ratios_of``: {ratio key: row metric}) to the baseline's row of
    the same repeat and load (None when the baseline did not run it; the baseline's own are 1)."""
    base = {(r["repeat"], r["load"]): r for r in rows if r["setup"] == baseline}
    out = []
    for row in rows:
        ref = base.get((row["repeat"], row["load"]))
        ratios = {key: _ratio(row[metric], ref[metric] if ref else None) for key, metric in ratios_of.items()}
        out.append({**row, **ratios})
    return out


def add_peer_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratios to vLLM (``RATIOS``) and to llama.cpp (``LLAMACPP_RATIOS``)."""
    return add_ratios(add_ratios(rows), baseline=LLAMACPP, ratios_of=LLAMACPP_RATIOS)


def spread_by_load(
    rows: Sequence[dict[str, Any]], metrics: Sequence[str] = SPREAD_METRICS
) -> list[dict[str, Any]]:
    """Per setup and load point, over the repeats that have a finite value of it: the median, min
    and max (``stats.spread``) of each of ``metrics`` (None where no repeat has it), in first-seen
    order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}  # {(setup, load): rows of every repeat}
    for row in rows:
        groups.setdefault((row["setup"], row["load"]), []).append(row)
    out = []
    for (setup, load), group in groups.items():
        entry: dict[str, Any] = {"setup": setup, "load": load, "repeats": len(group)}
        for metric in metrics:
            values = [r[metric] for r in group if r.get(metric) is not None and math.isfinite(r[metric])]
            spread_of = spread(values)
            for stat in ("median", "min", "max"):
                entry[f"{metric}_{stat}"] = None if spread_of is None else spread_of[stat]
        out.append(entry)
    return out


# ---------------------------------------------------------------------- terminal


TABLE_COLUMNS = {  # {title: row key}
    "setup": "setup",
    "load": "load",
    "done": "completed",
    "failed": "failed",
    "TTFT p50 ms": "ttft_ms_p50",
    "ITL p50 ms": "itl_ms_p50",
    "TPOT p50 ms": "tpot_ms_p50",
    "out tok/s": "out_tok_per_s",
    "tok/s ÷ vLLM": "tok_s_vs_vllm",
    "ITL ÷ vLLM": "itl_vs_vllm",
    "TTFT ÷ vLLM": "ttft_vs_vllm",
    "tok/s ÷ llama.cpp": "tok_s_vs_llamacpp",
    "ITL ÷ llama.cpp": "itl_vs_llamacpp",
    "TTFT ÷ llama.cpp": "ttft_vs_llamacpp",
    # CPU of pdserve's router, engine fronts and supervisor per streamed token (process_cpu)
    "outside µs/tok": "outside_engines_us_per_token",
    "other cores": "other_cores",  # busy with work not ours during the run (pdserve.bench.peers.foreign_load)
}


def fmt_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def print_rich_table(
    title: str, header: Sequence[str], body: Sequence[Sequence[str]], min_width: int = 150
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for line in body:
        table.add_row(*line)
    Console(width=max(min_width, Console().width)).print(table)  # a log file gets every column too


def _baselines_run(columns: dict[str, str], has: Callable[[str], bool]) -> dict[str, str]:
    """``columns`` ({title: key}) without the ratios to a baseline that did not run (``has(key)``
    false: every cell would be "-")."""
    return {title: key for title, key in columns.items() if "_vs_" not in key or has(key)}


def print_repeat_tables(rows: Sequence[dict[str, Any]], machine_line: str) -> None:
    """One table per repeat: every setup at every load point, with its ratios to vLLM and to
    llama.cpp (those that ran)."""
    repeats = sorted({r["repeat"] for r in rows})
    columns = _baselines_run(TABLE_COLUMNS, lambda key: any(r.get(key) is not None for r in rows))
    for repeat in repeats:
        body = [
            [fmt_cell(row.get(key)) for key in columns.values()] for row in rows if row["repeat"] == repeat
        ]
        print_rich_table(f"repeat {repeat + 1}/{len(repeats)} — {machine_line}", list(columns), body)
    print_cpu_per_token(rows)
    print_row_warnings(rows, lambda row: f"{row['setup']} {row['load']} repeat {row['repeat'] + 1}")


# The latency bounds an open-loop rate must keep to count as sustained (issue 42): every
# request done, time to first token p99 and inter-token latency p99 within these.
SLO_TTFT_P99_MS = 2000.0
SLO_ITL_P99_MS = 100.0


def meets_slo(row: dict[str, Any]) -> bool:
    """Every request of the run completed, with TTFT p99 and ITL p99 within the SLO."""
    ttft, itl = row.get("ttft_ms_p99"), row.get("itl_ms_p99")
    return (
        not row.get("failed")
        and row.get("completed") == row.get("num_prompts")
        and ttft is not None
        and itl is not None
        and ttft <= SLO_TTFT_P99_MS
        and itl <= SLO_ITL_P99_MS
    )


def sustained_rates(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setup and repeat, the open-loop sweep read against the SLO: the highest request rate
    kept, and whether a higher rate swept broke it (saturated: the sweep found the limit; not
    saturated: the setup kept even the highest rate swept, so its limit lies above), with the
    ratio to vLLM's in the same repeat."""
    out: list[dict[str, Any]] = []
    keys = sorted(
        {(r["setup"], r["repeat"]) for r in rows if r.get("request_rate")}, key=lambda k: (k[1], k[0])
    )
    for setup, repeat in keys:
        runs = sorted((r for r in rows if (r["setup"], r["repeat"]) == (setup, repeat) and r.get("request_rate")),
                      key=lambda r: r["request_rate"])  # fmt: skip
        kept = [r["request_rate"] for r in runs if meets_slo(r)]
        best = max(kept, default=None)
        broken_above = any(not meets_slo(r) and (best is None or r["request_rate"] > best) for r in runs)
        out.append({"setup": setup, "repeat": repeat, "max_rate_in_slo": best, "saturated": broken_above,
                    "rates": [r["request_rate"] for r in runs]})  # fmt: skip
    for entry in out:
        base = next((e for e in out if e["setup"] == BASELINE and e["repeat"] == entry["repeat"]), None)
        ratio = None
        if base is not None and base["max_rate_in_slo"] and entry["max_rate_in_slo"] is not None:
            ratio = entry["max_rate_in_slo"] / base["max_rate_in_slo"]
        entry["rate_vs_vllm"] = ratio
    return out


def print_sustained_rates(entries: Sequence[dict[str, Any]]) -> None:
    if not entries:
        return
    body = [[e["setup"], str(e["repeat"] + 1),
             fmt_cell(e["max_rate_in_slo"]) + ("" if e["saturated"] else " (kept every rate)"),
             fmt_cell(e["rate_vs_vllm"]), " ".join(f"{r:g}" for r in e["rates"])] for e in entries]  # fmt: skip
    title = (
        f"highest open-loop rate with TTFT p99 <= {SLO_TTFT_P99_MS:g} ms and ITL p99 <= {SLO_ITL_P99_MS:g} ms"
    )
    print_rich_table(title, ["setup", "repeat", "req/s", "÷ vLLM", "rates swept"], body, min_width=100)


def print_cpu_per_token(rows: Sequence[dict[str, Any]]) -> None:
    """Each run's CPU microseconds per streamed token by server process role (process_cpu)."""
    for row in rows:
        per = row.get("cpu_us_per_token")
        if per:
            roles = ", ".join(f"{role} {us:,.0f}" for role, us in per.items())
            print(f"  cpu us/token, {row['setup']} {row['load']} repeat {row['repeat'] + 1}: {roles}")


def print_row_warnings(rows: Sequence[dict[str, Any]], name: Callable[[dict[str, Any]], str]) -> None:
    """A line for every run that failed or shared the machine with other work (a suspect number)."""
    for row in rows:
        if row.get("error"):
            print(f"  {name(row)}: {row['error']}")
        if (row.get("other_cores") or 0.0) > BUSY_ELSEWHERE_CORES:
            print(
                f"  {name(row)}: other work kept {row['other_cores']:.2f} cores busy meanwhile: a suspect number"
            )


def spread_cell(entry: dict[str, Any], metric: str) -> str:
    """``median [min, max]`` of ``metric`` in a ``spread_by_load`` entry (the median alone for one
    repeat)."""
    median = entry[f"{metric}_median"]
    if median is None or entry["repeats"] < 2:
        return fmt_cell(median)
    return f"{fmt_cell(median)} [{fmt_cell(entry[f'{metric}_min'])}, {fmt_cell(entry[f'{metric}_max'])}]"


def print_spread(spreads: Sequence[dict[str, Any]], num_repeats: int) -> None:
    """Median [min, max] over the repeats of each key metric and ratio."""
    metrics = {"TTFT p50 ms": "ttft_ms_p50", "ITL p50 ms": "itl_ms_p50", "out tok/s": "out_tok_per_s",
               "tok/s ÷ vLLM": "tok_s_vs_vllm", "ITL ÷ vLLM": "itl_vs_vllm", "TTFT ÷ vLLM": "ttft_vs_vllm",
               "tok/s ÷ llama.cpp": "tok_s_vs_llamacpp", "ITL ÷ llama.cpp": "itl_vs_llamacpp",
               "TTFT ÷ llama.cpp": "ttft_vs_llamacpp"}  # fmt: skip
    metrics = _baselines_run(metrics, lambda key: any(e[f"{key}_median"] is not None for e in spreads))
    body = [[e["setup"], e["load"], *(spread_cell(e, m) for m in metrics.values())] for e in spreads]
    title = f"spread over {num_repeats} repeat(s): median [min, max]"
    print_rich_table(title, ["setup", "load", *metrics], body)


# ---------------------------------------------------------------------- plot


def plot(
    spreads: Sequence[dict[str, Any]], loads: Sequence[LoadPoint], setups: Sequence[str], path: str
) -> None:
    """Output tok/s (top) and ITL p50 (bottom) against the concurrency (left, closed loop) and
    the request rate (right, open loop), one line per setup: the median over repeats, the bar
    from min to max."""
    from pdserve.bench.common.report import new_figure, save_figure

    closed = [lp for lp in loads if lp.max_concurrency is not None]
    opened = [lp for lp in loads if lp.request_rate is not None]
    panels = [(kind, group) for kind, group in (("closed", closed), ("open", opened)) if group]
    if not panels:
        return
    fig, axes = new_figure(2, len(panels), figsize=(6 * len(panels), 7), squeeze=False)
    by_key = {(e["setup"], e["load"]): e for e in spreads}
    for col, (kind, group) in enumerate(panels):
        xs = [lp.max_concurrency if kind == "closed" else lp.request_rate for lp in group]
        for row_index, (metric, label) in enumerate(
            (("out_tok_per_s", "output tok/s"), ("itl_ms_p50", "ITL p50 (ms)"))
        ):
            ax = axes[row_index][col]
            drawn = False
            for setup in setups:
                points = [
                    (x, entry)
                    for x, lp in zip(xs, group, strict=True)
                    if (entry := by_key.get((setup, lp.name))) is not None
                    and entry[f"{metric}_median"] is not None
                ]
                if not points:
                    continue
                px = [x for x, _ in points]
                mid = [e[f"{metric}_median"] for _, e in points]
                low = [m - e[f"{metric}_min"] for m, (_, e) in zip(mid, points, strict=True)]
                high = [e[f"{metric}_max"] - m for m, (_, e) in zip(mid, points, strict=True)]
                ax.errorbar(px, mid, yerr=[low, high], marker="o", capsize=3, label=setup)
                drawn = True
            ax.set_xlabel("concurrent streams" if kind == "closed" else "request rate (req/s, Poisson)")
            ax.set_ylabel(label)
            if kind == "closed":
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}" for x in xs])
            ax.grid(alpha=0.3)
            if drawn:
                ax.legend(fontsize=8)
    axes[0][0].set_title("closed loop (max concurrency)" if panels[0][0] == "closed" else "open loop")
    if len(panels) > 1:
        axes[0][1].set_title("open loop (request rate)")
    save_figure(fig, path)
