"""Shared fixtures: a tiny deterministic model written to disk once per session."""

from __future__ import annotations

import os

import pytest

from pdserve import supervisor

# The suite compares greedy tokens across batch shapes, engines and transformers: exact in fp32,
# while bf16 rounding can flip a near-tie. So every engine and LLM the tests start computes in
# fp32 unless a test asks otherwise; bf16 (what --dtype auto picks on a CPU with native bf16)
# has its own quality tests (tests/engine/model/test_quality_bf16.py) and placement test.
os.environ.setdefault("PDSERVE_DTYPE", "float32")
# Likewise dense weights (--quantization none), which transformers' reference computes with: the
# default "auto" serves the bundled GGUF's blocks, whose matmuls sum in another order. The
# quantized modes have their own kernel, quality and engine tests.
os.environ.setdefault("PDSERVE_QUANTIZATION", "none")


def _give_this_worker_its_own_ports() -> None:
    """Each xdist worker picks its processes' ports from a slice of its own (children inherit
    the variable): picked free, a port is free only until the child binds it, and a router once
    reached the other worker's engine of the tiny model through such a port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or supervisor.FREE_PORTS_ENV in os.environ:
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    start, stop = supervisor.free_port_range()
    width = (stop - start) // max(workers, 1)
    low = start + int(worker[2:]) * width
    os.environ[supervisor.FREE_PORTS_ENV] = f"{low}-{low + width}"


_give_this_worker_its_own_ports()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from pdserve.engine.model.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pdserve import LLM

    return LLM(tiny_model_dir, max_model_len=1024, num_blocks=128, max_num_batched_tokens=1024)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fast tests first, then the ones marked ``slow`` (each group in file order): a broken
    change fails in the first minutes of ``make test``, not after the bundled-model and
    whole-cluster runs. Under xdist's ``--dist loadfile`` a file goes where its first test sorts."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
