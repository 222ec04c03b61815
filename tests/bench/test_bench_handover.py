"""``pdserve bench handover`` end to end on the tiny model: every phase runs, the JSON holds the
four goals and the per-stage breakdown, the plot is written and no process is left.

Structure and sanity only (presence, signs, orderings); no timing thresholds.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from pdserve.bench import handover
from pdserve.connector import transports
from pdserve.engine.model.tiny import write_tiny_model
from tests.helpers.processes import processes_mentioning

pytestmark = pytest.mark.slow  # a P/D cluster and a colocated engine, several phases: about a minute

# The pull phase starts a serving and a reading process for every installed transport (about 7 s
# a pair here, four pairs with ucx and nixl). Two keep the phase what it is (movers against the
# memcpy floor, the best one picked for the goals); the others run the same TransportPair code,
# and each transport is proven between two processes in tests/connector/test_transport_two_process.py.
PULL_TRANSPORTS = ("tcp", "shm")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-handover")
    model = write_tiny_model(str(root / "model"), seed=0)
    json_path, plot_path = root / "handover.json", root / "handover.png"
    argv = [
        "--model", model, "--prompt-tokens", "64", "--output-tokens", "4", "--requests", "3",
        "--load-rate", "4", "--load-requests", "4", "--load-output-tokens", "4", "--pull-iters", "3",
        "--engine-arg", "--num-blocks 64 --max-model-len 256",
        "--json", str(json_path), "--plot", str(plot_path),
    ]  # fmt: skip
    installed = transports.available_transports
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            transports, "available_transports", lambda: [n for n in installed() if n in PULL_TRANSPORTS]
        )
        code = handover.main(argv)
    with open(json_path) as f:
        payload = json.load(f)
    return code, payload, plot_path, model


def test_every_phase_reports_and_every_request_succeeds(bench_run):
    code, payload, plot_path, _ = bench_run
    assert code == 0, payload["errors"]
    assert payload["errors"] == []
    c1, load = payload["concurrency_1"], payload["load"]
    assert c1["requests"] == 3 and load["requests"] == 4 and load["failed"] == 0
    assert c1["pull_source"] == "timeline"  # the pull comes from each request's own timeline
    pulled = {row["transport"] for row in payload["pulls"]}
    assert pulled == {"memcpy", *(set(PULL_TRANSPORTS) & set(transports.available_transports()))}
    for key in (
        "handover_p50_ms",
        "decode_step_p50_ms",
        "pull_p50_ms",
        "ttft_pd_p50_ms",
        "ttft_colocated_p50_ms",
    ):
        assert c1[key] > 0 and math.isfinite(c1[key]), key
    assert c1["ttft_ratio"] == pytest.approx(c1["ttft_pd_p50_ms"] / c1["ttft_colocated_p50_ms"])
    assert load["handover_p50_ms"] > 0 and load["decode_step_p50_ms"] > 0
    assert load["itl_p99_ms"] >= load["decode_step_p50_ms"] and load["itl_mean_ms"] > 0
    assert 0 <= load["joined_in_flight"] <= load["requests"]
    assert os.path.getsize(plot_path) > 0


def test_the_four_goals_are_stated_with_their_targets(bench_run):
    _, payload, _, _ = bench_run
    goals = {g["goal"].split(" (")[0].split(",")[0]: g for g in payload["goals"]}
    assert len(payload["goals"]) == 5  # overhead, TTFT ratio, load handover, 16- and 64-token pulls
    for goal in payload["goals"]:
        assert isinstance(goal["met"], bool) and goal["target"][:2] in ("<=", ">=")
    assert any(name.startswith("16-token pull") for name in goals)


def test_stage_breakdown_covers_the_handover_in_order(bench_run):
    _, payload, _, _ = bench_run
    stages = [row["stage"] for row in payload["stages_concurrency_1"]]
    assert stages == [label for label, _, _ in handover.STAGES]
    assert all(row["p50_ms"] >= 0 for row in payload["stages_concurrency_1"])


def test_no_process_is_left(bench_run):
    *_, model = bench_run
    assert processes_mentioning(model) == []


def test_load_summary_takes_the_itl_p99_and_medians_of_the_later_gaps():
    # Later gaps of 10, 20, 30 and 40 ms after a 1 s handover.
    trace = handover.RequestTrace("pd", sent=0.0, token_times=[0.5, 1.5, 1.51, 1.53, 1.56, 1.6])
    load = handover.summarize([], [trace], [], None)["load"]
    assert load["requests"] == 1 and load["failed"] == 0
    assert load["handover_p50_ms"] == pytest.approx(1000.0)
    assert load["decode_step_p50_ms"] == pytest.approx(25.0) and load["itl_mean_ms"] == pytest.approx(25.0)
    assert load["itl_p99_ms"] == pytest.approx(39.7)  # rank 3 * 0.99 = 2.97, between 30 and 40
    assert math.isnan(load["pull_p50_ms"])  # no timeline and no transfer bench to fall back on
