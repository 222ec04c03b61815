"""``pdserve.bench.common.stats``: the one percentile, median, spread and CDF every benchmark
reports, on inputs worked out by hand, and the step its plots draw the CDF with."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from pdserve.bench.common.report import new_figure, plot_cdf
from pdserve.bench.common.stats import SPREAD_STATS, cdf, median, percentile, spread


def test_percentile_interpolates_linearly_between_the_two_nearest_ranks():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40; rank h = 3 q / 100
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0  # h = 1.5: halfway between 20 and 30
    assert percentile(values, 90) == pytest.approx(37.0)  # h = 2.7: 30 + 0.7 * 10
    assert percentile(values, 99) == pytest.approx(39.7)  # h = 2.97
    assert percentile([1.0, 2.0, 3.0, 4.0, 100.0], 50) == 3.0  # odd count: the middle value
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2.0 and isinstance(percentile([3, 1, 2], 50), float)


def test_percentile_is_numpys_default_and_not_nearest_rank():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.lognormvariate(3.0, 1.0) for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(values, q) == float(np.percentile(values, q))
    # h = 9 * 0.9 = 8.1: 90 + 0.1 * 10. Nearest rank would say 90 (the ceil(0.9 * 10)-th value),
    # the sorted list at index int(0.9 * 10) 100.
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0], 90) == pytest.approx(
        91.0
    )


def test_median_is_the_50th_percentile_computed_as_the_midpoint():
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([1.0, 2.0, 4.0, 10.0]) == 3.0  # (2 + 4) / 2
    assert median([]) is None
    rng = random.Random(1)
    for n in (2, 4, 7, 10):
        values = [rng.random() for _ in range(n)]
        assert median(values) == statistics.median(values) == float(np.median(values))
        assert median(values) == pytest.approx(percentile(values, 50), rel=1e-15)


def test_spread_gives_min_median_max_mean_and_sample_sd():
    entry = spread([4.0, 1.0, 2.0])
    assert entry is not None and tuple(entry) == SPREAD_STATS
    assert (entry["min"], entry["median"], entry["max"]) == (1.0, 2.0, 4.0)
    assert entry["mean"] == pytest.approx(7 / 3)
    # deviations from 7/3: -4/3, -1/3, 5/3; squares sum to 14/3; over n - 1 = 2
    assert entry["sd"] == pytest.approx(math.sqrt(7 / 3))
    assert spread([2.5]) == {"min": 2.5, "median": 2.5, "max": 2.5, "mean": 2.5, "sd": 0.0}
    assert spread([1.0, 3.0])["median"] == 2.0 and spread([1.0, 3.0])["sd"] == pytest.approx(math.sqrt(2))
    assert spread([]) is None


def test_cdf_steps_one_over_n_at_each_sorted_value():
    assert cdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    xs, ys = cdf([5.0, 5.0, 1.0, 9.0])
    assert xs == [1.0, 5.0, 5.0, 9.0] and ys == [0.25, 0.5, 0.75, 1.0]  # a tie: two steps at 5
    assert cdf([]) == ([], [])


def test_plot_cdf_draws_the_steps_and_nothing_for_no_values():
    fig, ax = new_figure()
    plot_cdf(ax, [], label="none")
    assert ax.get_lines() == []
    plot_cdf(ax, [3.0, 1.0, 2.0], label="three")
    (line,) = ax.get_lines()
    assert line.get_label() == "three" and line.get_drawstyle() == "steps-post"
    assert list(line.get_xdata()) == [1.0, 2.0, 3.0]
    assert list(line.get_ydata()) == pytest.approx([1 / 3, 2 / 3, 1.0])
