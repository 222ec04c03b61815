"""Shared fixtures: a tiny deterministic model written to disk once per session."""

from __future__ import annotations

import os

import pytest

# The suite compares greedy tokens across batch shapes, engines and transformers: exact in fp32,
# while bf16 rounding can flip a near-tie. So every engine and LLM the tests start computes in
# fp32 unless a test asks otherwise; bf16 (what --dtype auto picks on a CPU with native bf16)
# has its own quality tests (tests/test_quality_bf16.py) and placement test.
os.environ.setdefault("PDSERVE_DTYPE", "float32")
# Likewise dense weights (--quantization none), which transformers' reference computes with: the
# default "auto" serves the bundled GGUF's blocks, whose matmuls sum in another order. The
# quantized modes have their own kernel, quality and engine tests.
os.environ.setdefault("PDSERVE_QUANTIZATION", "none")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from pdserve.engine.model.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pdserve import LLM

    return LLM(tiny_model_dir, max_model_len=1024, num_blocks=128, max_num_batched_tokens=1024)


# Rough seconds of each file's slow tests (one process, 2-core AVX2 EPYC, `--durations`, 2026-11-26).
# Slow files run longest first: under `--dist loadfile` a worker takes the next file when it
# frees, so a long file taken last leaves the other worker idle for most of it; longest first
# (LPT scheduling) ends the suite with the short ones. Unlisted slow files count as short.
SLOW_FILE_SECONDS = {
    "test_bench_peers.py": 150,
    "test_bench_serve.py": 110,
    "test_bench_handover.py": 70,
    "test_quality_quant.py": 60,
    "test_llm_equivalence.py": 50,
    "test_compose.py": 45,
    "test_pd_two_process.py": 45,
    "test_bench_peers_long.py": 40,
    "test_discovery.py": 40,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fast tests first, then the ones marked ``slow``, longest files first (``SLOW_FILE_SECONDS``;
    otherwise in file order): a broken change fails in the first minutes of ``make test``, not
    after the bundled-model and whole-cluster runs. Under xdist's ``--dist loadfile`` a file goes
    where its first test sorts."""

    def order(item: pytest.Item) -> tuple[bool, int]:
        slow = item.get_closest_marker("slow") is not None
        return slow, -SLOW_FILE_SECONDS.get(item.path.name, 0) if slow else 0

    items.sort(key=order)
