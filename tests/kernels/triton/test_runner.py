"""The runner on the Triton kernels (CPU interpreter) generates what it does on the references.

Each path runs in its own subprocess: ``PDSERVE_KERNELS=triton`` with ``TRITON_INTERPRET=1``
sends every cache write and attention call of the model through ``pdserve.kernels.triton.ops``,
``PDSERVE_KERNELS=torch`` through the torch references. The subprocess also counts the calls
that reached the Triton wrappers, so a runner that bypassed the dispatcher cannot pass by
comparing the reference with itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

from tests.helpers.paths import REPO_ROOT

# Prints {"token_ids": [[...], ...], "triton_calls": {op: count}} for the model in argv[1].
_GENERATE = """
import collections, json, sys
from pdserve.kernels.triton import ops as triton_ops
calls = collections.Counter()
def counted(name, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper
for name in triton_ops.__all__:
    setattr(triton_ops, name, counted(name, getattr(triton_ops, name)))
from pdserve import LLM
from pdserve.engine.request import SamplingParams
llm = LLM(sys.argv[1], max_model_len=128, num_blocks=32, block_size=16, max_num_batched_tokens=128)
prompts = ["The capital of France is", "Hello, my name is Ada and I like"]
completions = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
print(json.dumps({"token_ids": [list(c.token_ids) for c in completions], "triton_calls": calls}))
"""


def _start(model_dir: str, backend: str, stderr: IO[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PDSERVE_KERNELS")}
    env["PDSERVE_KERNELS"] = backend
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    return subprocess.Popen(
        [sys.executable, "-c", _GENERATE, model_dir],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def _result(proc: subprocess.Popen, backend: str, stderr: IO[str]) -> dict:
    stdout, _ = proc.communicate(timeout=300)
    stderr.seek(0)
    assert proc.returncode == 0, f"{backend} run failed:\n{stderr.read()[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def test_kernel_runner_on_triton_interpreter_matches_torch_greedy_output(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    tiny = pytest.importorskip("pdserve.engine.model.tiny")
    model_dir = tiny.write_tiny_model(str(tmp_path / "tiny"), seed=0)

    # Both run at once; stderr goes to files, not pipes, so neither stalls while the other is read.
    with tempfile.TemporaryFile("w+") as torch_err, tempfile.TemporaryFile("w+") as triton_err:
        torch_run = _start(model_dir, "torch", torch_err)
        triton_run = _start(model_dir, "triton", triton_err)
        on_torch = _result(torch_run, "torch", torch_err)
        on_triton = _result(triton_run, "triton", triton_err)

    assert on_torch["triton_calls"] == {}
    calls = on_triton["triton_calls"]
    for op in ("reshape_and_cache", "paged_attention_prefill", "paged_attention_decode"):
        assert calls.get(op, 0) > 0, f"the runner never called triton_ops.{op}: {calls}"
    assert on_triton["token_ids"] == on_torch["token_ids"]
