"""The table and the plot of ``pdserve bench perplexity``: per model, llama.cpp's perplexity,
pdserve's in the compared mode (the verdict against the bound), llama.cpp's on a float32 copy
(``--llamacpp-f32``) and pdserve's in its default mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.bench.common.report import new_figure, save_figure

WIDTH = 200  # the table's, on a terminal or not
COLUMNS = (
    "model",
    "tokens",
    "chunks",
    "llama.cpp PPL",
    "pdserve PPL",
    "diff %",
    "verdict",
    "llama.cpp f32 PPL",
    "f32 diff %",
    "default mode",
    "default PPL",
    "default diff %",
    "llama.cpp s",
    "pdserve s",
    "default s",
)


def _mode(run: dict[str, Any]) -> str:
    return f"{run['dtype']} {run['quantization']}"


def table_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per model (a run not made leaves its cells empty)."""
    out = []
    for row in rows:
        theirs, ours, default = row.get("llamacpp"), row["compared"], row.get("default")
        cells: dict[str, Any] = {
            "model": row["model"],
            "tokens": row["tokens"],
            "chunks": row["chunks"],
            "pdserve PPL": f"{ours['ppl']:.4f}",
            "pdserve s": round(ours["load_seconds"] + ours["eval_seconds"], 1),
        }
        if theirs is not None:
            cells.update({
                "llama.cpp PPL": f"{theirs['ppl']:.4f}",
                "diff %": f"{100 * ours['diff']:+.3f}",
                "verdict": "PASS" if row["pass"] else "FAIL",
                "llama.cpp s": round(theirs["seconds"], 1),
            })  # fmt: skip
            if not row.get("ids_match", True):
                cells["verdict"] += " (llama.cpp's ids)"
        f32 = row.get("llamacpp_f32")
        if f32 is not None:
            cells.update(
                {"llama.cpp f32 PPL": f"{f32['ppl']:.4f}", "f32 diff %": f"{100 * ours['diff_f32']:+.3f}"}
            )
        if default is not None:
            cells.update({"default mode": _mode(default), "default PPL": f"{default['ppl']:.4f}",
                          "default s": round(default["load_seconds"] + default["eval_seconds"], 1)})  # fmt: skip
            if "diff" in default:
                cells["default diff %"] = f"{100 * default['diff']:+.3f}"
        out.append(cells)
    return out


def plot(rows: Sequence[dict[str, Any]], bound: float, path: str) -> None:
    """Each model's pdserve perplexity relative to llama.cpp's (%): the compared mode, the
    default mode, and the compared mode against llama.cpp's float32 copy, side by side where
    measured; the bound shaded. Nothing to plot without llama.cpp."""
    measured = [row for row in rows if "llamacpp" in row]
    if not measured:
        return
    series = [(f"pdserve {_mode(measured[0]['compared'])} vs llama.cpp", "compared", "diff")]
    if all("default" in row for row in measured):
        series.append(("pdserve default (auto, auto) vs llama.cpp", "default", "diff"))
    if all("llamacpp_f32" in row for row in measured):
        series.append(
            (f"pdserve {_mode(measured[0]['compared'])} vs llama.cpp f32 copy", "compared", "diff_f32")
        )
    fig, ax = new_figure(figsize=(max(6.0, 1.8 * len(measured)), 4.0))
    width = 0.8 / len(series)
    ax.axhspan(-100 * bound, 100 * bound, color="tab:green", alpha=0.15, label=f"±{bound:.1%} bound")
    ax.axhline(0.0, color="black", linewidth=0.8)
    for i, (label, run, diff) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(measured))], [100 * row[run][diff] for row in measured], width,
               label=label)  # fmt: skip
    ax.set_xticks(list(range(len(measured))))
    ax.set_xticklabels([row["model"] for row in measured], rotation=20, ha="right")
    ax.set_ylabel("PPL relative to llama-perplexity's (%)")
    ax.set_title(f"perplexity against llama.cpp, ctx {measured[0]['n_ctx']}")
    ax.legend(fontsize=7)
    save_figure(fig, path)
