"""``pdserve bench throughput`` end to end on the tiny model: both engines run the same seeded
workload, produce the same greedy tokens for every request, the JSON carries the documented keys
and a positive ratio, the plot is written next to it and no process is left behind.

Structure and correctness only; no timing thresholds.
"""

from __future__ import annotations

import json
import os

import pytest

from pdserve.bench.throughput import driver
from pdserve.bench.throughput.static_batching import length_sorted_batches
from pdserve.bench.throughput.workload import MIN_LEN, build_workload, read_lengths, sharegpt_like_lengths
from pdserve.engine.model.tiny import write_tiny_model
from tests.helpers.processes import children_of

NUM_REQUESTS = 6
MAX_PROMPT, MAX_OUTPUT = 64, 24


def _child_pids() -> set[int]:
    return set(children_of(os.getpid()))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-throughput")
    model = write_tiny_model(str(root / "model"), seed=0)
    json_path = root / "out" / "throughput.json"
    children_before = _child_pids()
    argv = [
        "--model", model, "--num-requests", str(NUM_REQUESTS), "--seed", "5",
        "--max-prompt-len", str(MAX_PROMPT), "--max-output-len", str(MAX_OUTPUT),
        "--batch-sizes", "1", "4", "--sweep-seconds", "0",
        "--json", str(json_path), "--save-outputs", "--no-progress",
    ]  # fmt: skip
    code = driver.main(argv)
    with open(json_path) as f:
        payload = json.load(f)
    return code, payload, json_path, children_before


def test_bench_throughput_reports_both_engines_and_the_ratio(bench_run):
    code, payload, json_path, _ = bench_run
    assert code == 0
    assert {"ratio", "model", "threads", "workload", "pdserve", "transformers", "outputs"} <= set(payload)
    assert payload["ratio"] > 0
    pd, hf = payload["pdserve"], payload["transformers"]
    for result in (pd, hf):
        assert result["seconds"] > 0 and result["req_per_s"] > 0 and result["out_tok_per_s"] > 0
    assert payload["ratio"] == pytest.approx(pd["out_tok_per_s"] / hf["out_tok_per_s"])
    assert pd["num_preemptions"] == 0  # the default KV cache holds the whole workload
    workload = payload["workload"]
    assert workload["num_requests"] == NUM_REQUESTS
    assert MIN_LEN <= workload["prompt_len"]["min"] <= workload["prompt_len"]["max"] <= MAX_PROMPT
    assert MIN_LEN <= workload["output_len"]["min"] <= workload["output_len"]["max"] <= MAX_OUTPUT
    # The sweep: one row per batch size, each measured on one batch (zero time box); the
    # fastest is chosen and then runs the whole workload (the top-level transformers result).
    sweep = {row["batch_size"]: row for row in hf["sweep"]}
    assert set(sweep) == {1, 4}
    assert [b for b, row in sweep.items() if row["chosen"]] == [hf["best_batch_size"]]
    best = sweep[hf["best_batch_size"]]
    assert best["out_tok_per_s"] == max(row["out_tok_per_s"] for row in sweep.values())
    for row in sweep.values():
        assert row["batches_run"] == 1 and row["seconds"] > 0 and row["output_tokens"] > 0
    assert os.path.getsize(json_path.with_suffix(".png")) > 0


def test_bench_throughput_greedy_outputs_identical_across_engines(bench_run):
    _, payload, _, _ = bench_run
    outputs = payload["outputs"]
    assert outputs["compared"] == outputs["identical"] == NUM_REQUESTS
    pairs = outputs["token_ids"]
    assert len(pairs) == NUM_REQUESTS
    lengths = [len(pair["pdserve"]) for pair in pairs]
    assert sum(lengths) == payload["workload"]["total_output_tokens"]
    for pair in pairs:
        assert pair["pdserve"] == pair["transformers"]


def test_bench_throughput_leaves_no_process(bench_run):
    *_, children_before = bench_run
    assert _child_pids() <= children_before


def test_sharegpt_like_lengths_are_seeded_and_clipped():
    first = sharegpt_like_lengths(500, seed=1, max_prompt_len=1024, max_output_len=512)
    assert first == sharegpt_like_lengths(500, seed=1, max_prompt_len=1024, max_output_len=512)
    assert first != sharegpt_like_lengths(500, seed=2, max_prompt_len=1024, max_output_len=512)
    prompts, outputs = zip(*first, strict=True)
    assert min(prompts) == MIN_LEN and max(prompts) <= 1024
    assert min(outputs) == MIN_LEN and max(outputs) == 512  # the long tail reaches the cap
    assert 100 < sum(prompts) / len(prompts) < 300 and 100 < sum(outputs) / len(outputs) < 300


def test_lengths_file_is_read_and_bad_lines_are_refused(tmp_path):
    good = tmp_path / "lengths.jsonl"
    good.write_text('{"prompt_len": 20, "output_len": 3}\n\n{"prompt_len": 7, "output_len": 9}\n')
    assert read_lengths(str(good)) == [(20, 3), (7, 9)]
    workload = build_workload(read_lengths(str(good)), vocab_size=289, seed=0, source=str(good))
    assert workload.prompt_lens == [20, 7] and workload.output_lens == [3, 9]
    assert all(100 <= t < 289 for prompt in workload.prompts for t in prompt)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_lengths(str(bad))
    bad.write_text('{"prompt": 4}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_lengths(str(bad))


def test_static_batches_group_similar_lengths():
    workload = build_workload([(30, 5), (10, 50), (20, 5), (40, 20)], vocab_size=289, seed=0, source="t")
    assert length_sorted_batches(workload, 2) == [[2, 0], [3, 1]]


def test_workload_summary_gives_each_lengths_spread_with_the_common_percentile():
    lengths = [(10 * (i + 1), 16) for i in range(10)]  # prompts of 10, 20, ..., 100 tokens
    summary = build_workload(lengths, vocab_size=289, seed=0, source="t").summary()
    # p90: rank 9 * 0.9 = 8.1 between 90 and 100 (stats.percentile's linear interpolation)
    assert summary["prompt_len"] == {
        "min": 10,
        "mean": 55.0,
        "median": 55.0,
        "p90": pytest.approx(91.0),
        "max": 100,
    }
    assert summary["output_len"] == {"min": 16, "mean": 16.0, "median": 16.0, "p90": 16.0, "max": 16}
    assert (summary["total_prompt_tokens"], summary["total_output_tokens"]) == (550, 160)
