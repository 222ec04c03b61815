"""Shared fixtures: a tiny deterministic model written to disk once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from pdserve.engine.model.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pdserve import LLM

    return LLM(tiny_model_dir, max_model_len=1024, num_blocks=128, max_num_batched_tokens=1024)
