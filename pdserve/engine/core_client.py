"""Front-side handle on an engine core process: start it, send requests, read outputs.

The front binds two ZMQ IPC sockets in a private temporary directory and starts the core as a
subprocess (configuration as JSON on its command line), so nothing but msgpack crosses.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from pdserve.engine import messages
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)


class EngineCoreError(RuntimeError):
    """The core process died or did not start."""


def spawn_core(
    config: EngineConfig,
    inputs: zmq.Socket,
    outputs: zmq.Socket,
    env: dict[str, str] | None = None,
    log_level: str = "INFO",
) -> tuple[str, subprocess.Popen]:
    """Bind ``inputs``/``outputs`` to IPC paths in a private directory and start the core there.

    The configuration (which may hold the cluster token) goes through the child's stdin, not its
    command line, so ``ps`` does not show it.
    """
    ipc_dir = tempfile.mkdtemp(prefix="pdserve-core-")
    input_addr, output_addr = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    inputs.bind(input_addr)
    outputs.bind(output_addr)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve.engine.core_proc",
            "--input", input_addr,
            "--output", output_addr,
            "--log-level", log_level,
        ],
        env={**os.environ, **(env or {})},
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(config.to_json().encode())
    proc.stdin.close()
    return ipc_dir, proc


def add_request_message(
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    kv_transfer_params: dict[str, Any] | None,
    priority: int,
) -> dict[str, Any]:
    return {
        "type": messages.ADD,
        "request_id": request_id,
        "prompt_token_ids": list(prompt_token_ids),
        "sampling_params": messages.sampling_to_dict(sampling_params),
        "kv_transfer_params": kv_transfer_params,
        "priority": priority,
        "arrival_time": time.time(),
    }


class EngineCoreClient:
    """Blocking client (tests, scripts); servers use ``AsyncEngineCoreClient``."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        log_level: str = "INFO",
    ) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.outputs = self.ctx.socket(zmq.PULL)
        self._ipc_dir, self.proc = spawn_core(config, self.inputs, self.outputs, env, log_level)
        self._nonce = itertools.count()
        self._buffered: list[EngineCoreOutput] = []
        self.info = self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise EngineCoreError(f"engine core exited with code {self.proc.returncode} during start-up")
            if self.outputs.poll(100):
                message = messages.decode(self.outputs.recv())
                if message["type"] == messages.READY:
                    return message["info"]
        self.close()
        raise EngineCoreError(f"engine core not ready after {timeout_s:.0f}s")

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> None:
        self._send(add_request_message(request_id, prompt_token_ids, sampling_params, kv_transfer_params, priority))

    def abort(self, request_ids: list[str]) -> None:
        self._send({"type": messages.ABORT, "request_ids": list(request_ids)})

    def get_outputs(self, timeout_s: float | None = None) -> list[EngineCoreOutput]:
        """Outputs that arrived, waiting up to ``timeout_s`` for the first (None: forever)."""
        if self._buffered:
            out, self._buffered = self._buffered, []
            return out
        wait_ms = -1 if timeout_s is None else int(timeout_s * 1000)
        outputs: list[EngineCoreOutput] = []
        while self.outputs.poll(wait_ms):
            wait_ms = 0
            message = messages.decode(self.outputs.recv())
            if message["type"] == messages.OUTPUTS:
                outputs.extend(messages.output_from_dict(o) for o in message["outputs"])
        if not outputs:
            self._check_alive()
        return outputs

    def call(self, kind: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """A request/reply (stats, reset_prefix_cache); outputs that arrive meanwhile are kept."""
        nonce = next(self._nonce)
        self._send({"type": kind, "nonce": nonce})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.outputs.poll(100):
                self._check_alive()
                continue
            message = messages.decode(self.outputs.recv())
            if message["type"] == messages.OUTPUTS:
                self._buffered.extend(messages.output_from_dict(o) for o in message["outputs"])
            elif message["type"] == messages.STATS_REPLY and message.get("nonce") == nonce:
                return message
        raise EngineCoreError(f"no reply to {kind!r} within {timeout_s}s")

    def stats(self) -> dict[str, Any]:
        return self.call(messages.STATS)["stats"]

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> EngineCoreOutput:
        """Blocking convenience for tests: one request to completion, outputs merged."""
        self.add_request(request_id, prompt_token_ids, sampling_params, kv_transfer_params)
        merged = EngineCoreOutput(request_id=request_id, new_token_ids=[])
        deadline = time.monotonic() + timeout_s
        others: list[EngineCoreOutput] = []
        while time.monotonic() < deadline:
            for output in self.get_outputs(timeout_s=0.1):
                if output.request_id != request_id:
                    others.append(output)
                    continue
                merged.new_token_ids.extend(output.new_token_ids)
                if output.finished:
                    merged.finish_reason = output.finish_reason
                    merged.kv_transfer_params = output.kv_transfer_params
                    merged.stop_reason = output.stop_reason
                    merged.num_cached_tokens = output.num_cached_tokens
                    self._buffered.extend(others)
                    return merged
        self._buffered.extend(others)
        raise TimeoutError(f"request {request_id} did not finish within {timeout_s}s")

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: dict[str, Any]) -> None:
        self._check_alive()
        self.inputs.send(messages.encode(message))

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise EngineCoreError(f"engine core exited with code {self.proc.returncode}")

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.inputs.send(messages.encode({"type": messages.SHUTDOWN}), zmq.NOBLOCK)
                self.proc.wait(timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
