"""``pdserve bench serve`` end to end on the tiny model: every setup of the run runs (also over
repeats), every request is accounted for, the JSON has the documented keys (the chunk sweep and
its choice, the spread and the verdicts too), the plots are written and no process is left.

Structure and sanity only (counts, signs, orderings); no timing thresholds.
"""

from __future__ import annotations

import json
import math
import os
import socket

import pytest

from pdserve.bench.serve import chunk_sweep, driver
from pdserve.bench.serve.report import KEY_METRICS, REQUEST_KEYS, ROW_KEYS, STAGES, verdicts
from pdserve.bench.serve.workload import OpenLoopWorkload, load_dataset, parse_length
from pdserve.engine.model.tiny import write_tiny_model
from tests.helpers.processes import processes_mentioning

NUM_REQUESTS = 4
OUTPUT_LEN = 4
# The setups the module's run starts: one colocated setup (the chunked one, which needs the
# sweep) and pd, so every verdict still compares pd with a colocated setup.
RUN_SETUPS = ("colocated-chunked", "pd")
PLOTS = ("serve_ttft_cdf.png", "serve_itl_cdf.png", "serve_goodput.png", "serve_pd_breakdown.png")


@pytest.mark.slow
def test_bench_serve_reports_every_request_of_every_setup(two_setup_run):
    _, payload, _, _ = two_setup_run
    assert payload["config"]["cpus"]
    for row in payload["rows"]:
        assert row["rate"] == 4.0
        assert row["num_requests"] == row["completed"] == NUM_REQUESTS
        assert row["duration_s"] > 0 and row["req_per_s"] > 0 and row["out_tok_per_s"] > 0
        assert 0.0 <= row["goodput_frac"] <= 1.0
        assert row["goodput_req_per_s"] <= row["req_per_s"] + 1e-9
        for metric in ("ttft", "itl", "tpot", "e2e"):
            p50, p90, p99 = (row[f"{metric}_ms_p{q}"] for q in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99, (row["setup"], metric)
            assert row[f"{metric}_ms_mean"] > 0
        assert row["ttft_ms_p50"] <= row["e2e_ms_p50"]
        assert row["queue_ms_mean"] >= 0 and row["prefill_ms_mean"] > 0
        if row["setup"] == "pd":
            for stage in STAGES:
                assert (
                    row[f"{stage}_ms_mean"] is not None and row[f"{stage}_ms_p50"] <= row[f"{stage}_ms_p99"]
                )
            assert row["transfer_ms_p50"] > 0 and row["decode_ms_mean"] > 0
        else:
            assert row["transfer_ms_mean"] is None and row["decode_ms_mean"] is None


@pytest.mark.slow
def test_bench_serve_request_records_are_complete_and_consistent(two_setup_run):
    _, payload, _, _ = two_setup_run
    records = payload["requests"]
    for rec in records:
        assert rec["num_tokens"] == rec["output_len"] == OUTPUT_LEN
        assert 24 <= rec["prompt_len"] <= 80
        assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]
        assert rec["tpot_ms"] > 0 and 0 < rec["itl_p90_ms"] <= rec["itl_max_ms"]
        assert isinstance(rec["meets_slo"], bool)
        if rec["setup"] == "pd":
            assert rec["transfer_ms"] > 0
    for row in payload["rows"]:  # goodput is the share of that setup's requests within the SLO
        mine = [r["meets_slo"] for r in records if (r["setup"], r["repeat"]) == (row["setup"], row["repeat"])]
        assert len(mine) == NUM_REQUESTS and math.isclose(sum(mine) / NUM_REQUESTS, row["goodput_frac"])


def test_an_engine_that_loses_its_port_is_started_again_on_another(tmp_path, monkeypatch, tiny_model_dir):
    from pdserve import supervisor

    with socket.socket() as taken:
        taken.bind((driver.HOST, 0))
        taken.listen()
        picks = iter([[taken.getsockname()[1]], supervisor.pick_free_ports(driver.HOST, 1)])
        monkeypatch.setattr(supervisor, "pick_free_ports", lambda host, count: next(picks))
        messages: list[str] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}

        def argv(port: int) -> list[str]:
            return ["serve", "--host", driver.HOST, "--port", str(port), "--model", tiny_model_dir,
                    "--max-model-len", "256", "--num-blocks", "64"]  # fmt: skip

        with driver.SetupProcesses(str(tmp_path), env, messages.append) as procs:
            (engine,) = procs.start([("engine", argv, None)])
            assert engine.address != f"{driver.HOST}:{taken.getsockname()[1]}"
            assert supervisor.check_health(engine.address)
            assert procs.children == [engine]
        assert engine.popen.poll() is not None
    assert any("port taken" in m for m in messages)


def test_workload_is_seeded_shares_its_prefix_and_differs_per_rate():
    def workload(seed: int) -> OpenLoopWorkload:
        return OpenLoopWorkload(
            prompt_len=(40, 60),
            output_len=(2, 9),
            dataset=None,
            shared_prefix_frac=0.5,
            seed=seed,
            token_range=(100, 1000),
        )

    first, again = workload(1).draw(20, 2.0, stream=1), workload(1).draw(20, 2.0, stream=1)
    assert first == again
    assert first != workload(2).draw(20, 2.0, stream=1)
    other_rate = workload(1).draw(20, 2.0, stream=2)
    assert all(
        a.prompt_token_ids[20:] != b.prompt_token_ids[20:] for a, b in zip(first, other_rate, strict=True)
    )
    arrivals = [s.arrival_s for s in first]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    for spec in first:
        assert 40 <= len(spec.prompt_token_ids) <= 60 and 2 <= spec.output_len <= 9
        assert all(100 <= t < 1000 for t in spec.prompt_token_ids)
    assert len({tuple(s.prompt_token_ids[:20]) for s in first}) == 1  # 0.5 * 40 tokens at least
    assert all(s.arrival_s == 0.0 for s in workload(1).draw(5, math.inf, stream=1))


def test_lengths_and_dataset_parsing(tmp_path):
    assert parse_length("512") == (512, 512)
    assert parse_length("128:1024") == (128, 1024)
    for bad in ("0", "10:5", "x"):
        with pytest.raises(ValueError):
            parse_length(bad)
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"prompt_len": 100, "output_len": 7}\n\n{"prompt_len": 30, "output_len": 2}\n')
    assert load_dataset(str(path)) == [(100, 7), (30, 2)]
    spec = OpenLoopWorkload((1, 1), (1, 1), load_dataset(str(path)), 0.0, 0, (5, 50)).draw(6, 1.0, stream=1)
    assert {(len(s.prompt_token_ids), s.output_len) for s in spec} <= {(100, 7), (30, 2)}
    path.write_text('{"prompt_len": 100}\n')
    with pytest.raises(ValueError, match="lengths.jsonl:1"):
        load_dataset(str(path))


@pytest.mark.slow
def test_bench_serve_api_both_alternates_the_front_doors_and_reports_the_http_overhead(tmp_path):
    """``--api both``: one open loop whose requests alternate between the router's gRPC API and
    its OpenAI HTTP API on the same processes; every token is counted through both."""
    model = write_tiny_model(str(tmp_path / "model"), seed=0)
    json_path = tmp_path / "serve.json"
    argv = [
        "--model", model, "--setups", "pd", "--api", "both", "--rates", "4", "--num-requests", "6",
        "--prompt-len", "24:80", "--output-len", str(OUTPUT_LEN), "--warmup", "1",
        "--engine-args", "--num-blocks 128 --max-num-batched-tokens 512", "--max-model-len", "256",
        "--json", str(json_path), "--plot-dir", str(tmp_path / "plots"), "--no-progress",
    ]  # fmt: skip
    assert driver.main(argv) == 0
    payload = json.loads(json_path.read_text())
    assert [r["setup"] for r in payload["rows"]] == ["pd", "pd/openai"]
    for row in payload["rows"]:
        assert row["num_requests"] == row["completed"] == 3 and row["failed"] == 0
    http_records = [r for r in payload["requests"] if r["setup"] == "pd/openai"]
    assert len(http_records) == 3
    for rec in http_records:
        assert rec["error"] is None and rec["num_tokens"] == OUTPUT_LEN
        assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]
    (overhead,) = payload["front_overhead"]
    assert overhead["setup"] == "pd" and overhead["rate"] == 4.0
    for metric in ("ttft", "itl"):
        grpc_ms, http_ms = overhead[f"{metric}_ms_p50_grpc"], overhead[f"{metric}_ms_p50_http"]
        assert grpc_ms > 0 and http_ms > 0
        assert math.isclose(overhead[f"{metric}_ms_p50_added"], http_ms - grpc_ms)
    assert processes_mentioning(model) == []


@pytest.fixture(scope="module")
def two_setup_run(tmp_path_factory):
    """Two repeats of ``colocated-chunked`` and ``pd``, the chunk budget chosen by a real (tiny)
    sweep; half of every prompt a shared prefix. One run serves every test of a whole run's
    output: its clusters (one per setup and repeat, ~20 s each on 2 cores) are most of this
    file's time.

    Plain ``colocated`` is left out (two clusters, ~40 s): it is ``colocated-chunked`` without
    the budget flags (same processes, router and client code in ``start_setup``), so the chunked
    setup runs every line it would; that it is in the default set is checked on the parser."""
    root = tmp_path_factory.mktemp("bench-serve-2")
    model = write_tiny_model(str(root / "model"), seed=0)
    json_path = root / "serve.json"
    argv = [
        "--model", model, "--setups", *RUN_SETUPS, "--rates", "4", "--repeats", "2",
        "--num-requests", str(NUM_REQUESTS),
        "--prompt-len", "24:80", "--output-len", str(OUTPUT_LEN), "--shared-prefix-frac", "0.5",
        "--warmup", "1", "--seed", "5", "--chunk-candidates", "32", "64", "--chunk-sweep-repeats", "1",
        "--engine-args", "--num-blocks 128 --max-num-batched-tokens 512", "--max-model-len", "256",
        "--json", str(json_path), "--plot-dir", str(root / "plots"), "--no-progress",
    ]  # fmt: skip
    code = driver.main(argv)
    with open(json_path) as f:
        payload = json.load(f)
    return code, payload, root / "plots", model


@pytest.mark.slow
def test_bench_serve_runs_each_setup_in_every_repeat(two_setup_run):
    code, payload, plot_dir, model = two_setup_run
    assert code == 0
    assert driver.build_parser().parse_args([]).setups == list(driver.SETUPS)
    assert list(driver.SETUPS) == ["colocated", "colocated-chunked", "pd"]
    assert payload["config"]["setups"] == list(RUN_SETUPS)
    rows = payload["rows"]
    # Repeat-major: each repeat runs every setup before the next repeat starts.
    assert [(r["repeat"], r["setup"]) for r in rows] == [(rep, s) for rep in (0, 1) for s in RUN_SETUPS]
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        assert row["completed"] == NUM_REQUESTS and row["failed"] == 0
    records = payload["requests"]
    assert len(records) == 2 * len(RUN_SETUPS) * NUM_REQUESTS
    assert all(set(rec) == set(REQUEST_KEYS) and rec["error"] is None for rec in records)

    def prompt_lens(setup: str, repeat: int) -> list[int]:
        return [r["prompt_len"] for r in records if r["setup"] == setup and r["repeat"] == repeat]

    for repeat in (0, 1):  # the same requests for every setup within a repeat...
        assert prompt_lens("colocated-chunked", repeat) == prompt_lens("pd", repeat)
    assert prompt_lens("pd", 0) != prompt_lens("pd", 1)  # ...and a fresh draw per repeat
    for name in PLOTS:
        assert (plot_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert processes_mentioning(model) == []


@pytest.mark.slow
def test_bench_serve_records_the_chunk_sweep_and_its_choice(two_setup_run):
    _, payload, _, _ = two_setup_run
    chunk = payload["chunk"]
    assert chunk["source"] == "sweep" and chunk["tokens"] in (32, 64) and chunk["reason"]
    assert payload["config"]["chunk_tokens"] == chunk["tokens"]
    sweep = chunk["sweep"]
    assert sweep["batch"] >= 1 and sweep["threads"] == 1
    assert [r["tokens"] for r in sweep["rows"]] == [None, 32, 64]
    for row in sweep["rows"]:
        assert row["decode_step_ms"] > 0 and row["mixed_step_ms"] > 0 and row["prefill_ms"] > 0
        assert math.isclose(row["ratio"], row["mixed_step_ms"] / row["decode_step_ms"])
    assert (
        chunk_sweep.choose_chunk(sweep["rows"], chunk["max_ratio"], chunk["max_step_ms"])[0]
        == chunk["tokens"]
    )


@pytest.mark.slow
def test_bench_serve_reports_spread_and_verdicts_over_repeats(two_setup_run):
    _, payload, _, _ = two_setup_run
    spreads = payload["spread"]
    assert sorted(e["setup"] for e in spreads) == sorted(RUN_SETUPS)
    for entry in spreads:
        assert entry["repeats"] == 2 and entry["rate"] == 4.0
        for metric in KEY_METRICS:
            lo, mid, hi = (entry[f"{metric}_{s}"] for s in ("min", "median", "max"))
            assert lo <= mid <= hi and entry[f"{metric}_sd"] >= 0
    claims = payload["verdicts"]
    assert [c["metric"] for c in claims] == list(KEY_METRICS)
    for claim in claims:
        assert claim["verdict"] in ("pd better", "pd worse", "no claim")
        assert [p["repeat"] for p in claim["per_repeat"]] == [0, 1]
        # the only colocated setup of the run is the baseline in every repeat
        assert {p["best_colocated_setup"] for p in claim["per_repeat"]} == {"colocated-chunked"}


def test_verdict_is_claimed_only_where_it_holds_in_every_repeat():
    def row(setup: str, repeat: int, goodput: float, itl_p99: float) -> dict:
        values = dict.fromkeys(KEY_METRICS, 1.0)
        values.update(goodput_req_per_s=goodput, itl_ms_p99=itl_p99)
        return {"setup": setup, "rate": 0.5, "repeat": repeat, **values}

    rows = [
        row("colocated", 0, 0.10, 900.0), row("colocated-chunked", 0, 0.20, 300.0), row("pd", 0, 0.25, 200.0),
        row("colocated", 1, 0.10, 900.0), row("colocated-chunked", 1, 0.30, 250.0), row("pd", 1, 0.25, 220.0),
    ]  # fmt: skip
    claims = {c["metric"]: c for c in verdicts(rows, driver.COLOCATED_SETUPS)}
    # Goodput: P/D beats chunked in repeat 0 but not in repeat 1 -> no claim.
    assert claims["goodput_req_per_s"]["verdict"] == "no claim"
    assert [p["best_colocated"] for p in claims["goodput_req_per_s"]["per_repeat"]] == [0.20, 0.30]
    # ITL p99: lower than the best colocated (chunked) in both repeats -> a claim.
    assert claims["itl_ms_p99"]["verdict"] == "pd better"
    assert claims["ttft_ms_p50"]["verdict"] == "no claim"  # ties everywhere
    rows[2]["itl_ms_p99"] = 400.0
    rows[5]["itl_ms_p99"] = 300.0
    assert {c["metric"]: c for c in verdicts(rows, driver.COLOCATED_SETUPS)}["itl_ms_p99"][
        "verdict"
    ] == "pd worse"


def test_chunk_rule_picks_the_largest_budget_within_the_ratio_else_within_the_slo_else_the_smallest():
    def sweep(*ratios: float) -> list[dict]:
        rows = [{"tokens": None, "decode_step_ms": 100.0, "mixed_step_ms": 2000.0, "ratio": 20.0}]
        for tokens, ratio in zip((32, 64, 128, 256), ratios, strict=False):
            rows.append(
                {"tokens": tokens, "decode_step_ms": 100.0, "mixed_step_ms": 100 * ratio, "ratio": ratio}
            )
        return rows

    assert chunk_sweep.choose_chunk(sweep(1.1, 1.3, 1.6, 2.5), 1.5)[0] == 64
    assert chunk_sweep.choose_chunk(sweep(1.1, 1.3, 1.4, 1.5), 1.5)[0] == 256
    tokens, reason = chunk_sweep.choose_chunk(sweep(1.9, 2.3, 4.0, 7.6), 1.5)
    assert tokens == 32 and "no budget" in reason
    # None within the ratio: the largest whose step fits the inter-token SLO, else the smallest.
    tokens, reason = chunk_sweep.choose_chunk(sweep(3.1, 5.1, 8.3, 11.9), 1.5, max_step_ms=600.0)
    assert tokens == 64 and "inter-token SLO" in reason
    assert chunk_sweep.choose_chunk(sweep(6.0, 7.0, 8.0, 9.0), 1.5, max_step_ms=500.0)[0] == 32
    assert chunk_sweep.typical_decode_batch(0.25, 64, 0.1) == 2
    assert chunk_sweep.typical_decode_batch(0.0, 64, 0.1) == 1
    assert chunk_sweep.engine_args_for_budget(32) == [
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "32",
    ]


def test_chunk_tokens_flag_skips_the_sweep(tmp_path):
    args = driver.build_parser().parse_args(["--chunk-tokens", "48"])
    workload = OpenLoopWorkload((512, 512), (64, 64), None, 0.0, 0, (0, 1))
    chunk = driver.choose_chunk_tokens(args, workload, [0], str(tmp_path), {}, lambda message: None)
    assert chunk["tokens"] == 48 and chunk["source"] == "--chunk-tokens" and chunk["sweep"] is None
