"""The statistics every benchmark reports, each with one convention (the same in every table,
JSON file and plot, so two benchmarks' p99 or median mean the same thing):

- ``percentile(values, q)``: ``q`` in [0, 100], by linear interpolation between the two
  nearest ranks;
- ``median(values)``: the 50th percentile of that same convention;
- ``spread(values)``: min, median, max, mean and sample standard deviation of repeated
  measurements (one number per repeat);
- ``cdf(values)``: the empirical cumulative distribution, a step of 1/n at each value.

Each of them takes any sequence of numbers and returns plain floats (None where there are no
values: a report writes ``null``, not a made-up number).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

SPREAD_STATS = ("min", "median", "max", "mean", "sd")  # the keys of ``spread()``, in its order


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values``, ``q`` in [0, 100] (``percentile(x, 99)`` is p99).

    Linear interpolation between the two nearest ranks (numpy's default ``method="linear"``,
    Hyndman and Fan's type 7, what vLLM's ``vllm bench serve`` reports): with the values sorted
    ``x[0] <= ... <= x[n-1]`` and ``h = (n - 1) * q / 100``, it is ``x[floor(h)] + (h - floor(h))
    * (x[floor(h) + 1] - x[floor(h)])``. So p0 is the min, p100 the max, p50 the median, and a
    percentile between two samples lies between them: of [10, 20, 30, 40], p50 is 25 and p90 is
    37. None for no values.
    """
    if len(values) == 0:
        return None
    return float(np.percentile(values, q))


def median(values: Sequence[float]) -> float | None:
    """``percentile(values, 50)``: the middle value, or the mean of the two middle ones.

    Computed as ``statistics.median`` does, ``(a + b) / 2`` for the two middle values ``a <= b``
    (numpy's interpolation, ``a + (b - a) / 2``, can differ from it in the last bit). None for no
    values.
    """
    if len(values) == 0:
        return None
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """How repeated measurements of one number spread: ``{"min", "median", "max", "mean", "sd"}``
    (``SPREAD_STATS``). The median is ``median()``'s; sd is the sample standard deviation (n - 1
    in the denominator), 0.0 for a single value. None for no values.

    Of [1, 2, 4]: min 1, median 2, max 4, mean 7/3, sd sqrt(7/3) (deviations -4/3, -1/3 and 5/3,
    squares summing to 14/3, over 2).
    """
    if len(values) == 0:
        return None
    mid = median(values)
    assert mid is not None
    return {
        "min": float(min(values)),
        "median": mid,
        "max": float(max(values)),
        "mean": float(np.mean(values)),
        "sd": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
    }


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF of ``values``: ``(xs, ys)``, ``xs`` the values sorted and ``ys[i] = (i +
    1) / n``, the fraction of values ``<= xs[i]`` (ties each get their own step). Drawn as a step
    that rises at each value (``report.plot_cdf``). Of [3, 1, 2]: ([1, 2, 3], [1/3, 2/3, 1]).
    Empty lists for no values.
    """
    xs = sorted(float(v) for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]
