"""The client side of ``pdserve bench peers``: ``vllm bench serve`` runs from the side venv.

Every run streams from the completions endpoint (``--backend openai``) on vLLM's random dataset,
seeded, and saves its result file with the per-request lists (``--save-detailed``); a run that
outlives ``--run-timeout`` is killed with its process group. Shared by the load-point sweep
(``pdserve.bench.peers.driver``) and the long-prompt scenario (``pdserve.bench.peers.long_scenario``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.bench.peers.llamacpp import CLIENT_ARGS, LlamaCppShape
from pdserve.bench.peers.side_venv import PeerVenv


@dataclass
class Context:
    """What every setup and client run of one invocation shares."""

    args: argparse.Namespace
    venv: PeerVenv
    hf_dir: str  # the weights and tokenizer as an HF directory: vLLM's model, the client's tokenizer
    gguf: str | None  # the GGUF, if the model is one (llama-server's model)
    log_dir: str
    env: dict[str, str]  # pdserve's processes
    peer_env: dict[str, str]  # the side venv's processes
    say: Callable[[str], None]
    llamacpp: LlamaCppShape | None = None  # how llama-server runs, when it is a setup
    guidellm: str | None = None  # guidellm's executable, when it is the client (--client guidellm)


def random_dataset(input_len: int, output_len: int, range_ratio: float = 0.0) -> list[str]:
    """The random dataset's flags: prompts of ``input_len`` tokens, or uniform in
    ``input_len * (1 -+ range_ratio)``; always exactly ``output_len`` output tokens (the ratio is
    given for the input alone: a bare float would spread the output lengths too)."""
    argv = ["--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len)]  # fmt: skip
    if range_ratio > 0:
        argv += ["--random-range-ratio", f'{{"input": {range_ratio:g}, "output": 0}}']
    return argv


def client_argv(ctx: Context, setup: str, base_url: str, model_name: str, dataset: Sequence[str],
                load: Sequence[str], seed: int, result_dir: str, result_name: str) -> list[str]:  # fmt: skip
    """``vllm bench serve`` against ``setup`` at ``base_url``: ``dataset`` (``random_dataset``) at
    ``load`` (``--num-prompts`` and ``--max-concurrency`` or ``--request-rate``), EOS ignored."""
    args = ctx.args
    server_needs = CLIENT_ARGS if setup == "llamacpp" else ()
    return [
        *ctx.venv.bench_argv(),
        "--backend", "openai", "--base-url", base_url, "--model", model_name, "--tokenizer", ctx.hf_dir,
        *dataset, "--ignore-eos", "--seed", str(seed), "--temperature", f"{args.temperature:g}",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", result_name,
        "--disable-tqdm", *server_needs, *load, *shlex.split(args.client_args),
    ]  # fmt: skip


def run_client(
    ctx: Context, argv: list[str], log_path: str, label: str, stop: threading.Event | None = None
) -> int:
    """Run the client with its output in ``log_path``, a progress line every 15 s; its exit code
    (-1 after ``--run-timeout`` or once ``stop`` is set, when its process group is killed)."""
    start = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=ctx.peer_env, start_new_session=True)  # fmt: skip
        try:
            last_note = start
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.monotonic()
                if stop is not None and stop.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return -1
                if now - start > ctx.args.run_timeout:
                    ctx.say(f"{label}: no result after {ctx.args.run_timeout:.0f}s, stopping the client")
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return -1
                if now - last_note >= 15.0:
                    last_note = now
                    ctx.say(f"{label}: running ({now - start:.0f}s)")
        finally:
            if proc.poll() is None:  # interrupted: take the client down with us
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode


def log_tail(path: str, num_lines: int = 15) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-num_lines:])
    return ""
