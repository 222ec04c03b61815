"""What every benchmark ends with: a table on the terminal, a JSON file and a PNG plot.

Results go under ``bench-results/`` unless a benchmark is told another path; plots are drawn on
matplotlib's Agg backend, so a server without a display can write them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pdserve.bench.common.stats import cdf

RESULTS_DIR = "bench-results"


def default_path(name: str, ext: str) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    return os.path.join(RESULTS_DIR, f"{name}.{ext}")


def print_table(
    title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str], width: int | None = None
) -> None:
    """``rows`` as a table of ``columns``; ``width``: the console's, when a wide table should not
    be squeezed into the 80 columns rich assumes when stdout is not a terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(column)) for column in columns))
    Console(width=width).print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)


def save_json(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def new_figure(*args: Any, **kwargs: Any):
    """A matplotlib figure on the Agg backend (no display on servers and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_cdf(ax: Any, values: Sequence[float], **style: Any) -> None:
    """The empirical CDF of ``values`` (``stats.cdf``) on ``ax``: a step rising 1/n at each value,
    ``style`` passed to matplotlib (``label``, ``color`` ...). Nothing for no values."""
    xs, ys = cdf(values)
    if xs:
        ax.step(xs, ys, where="post", **style)
