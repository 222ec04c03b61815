"""asyncio handle on an engine core process, for the gRPC engine servers.

One task reads the core's output socket and routes each output to the queue of the stream
that asked for it, so any number of concurrent ``Generate`` calls share one core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import time
from typing import Any

import zmq
import zmq.asyncio

from pdserve.engine import messages
from pdserve.engine.core_client import EngineCoreError, add_request_message, spawn_core
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineCoreClient:
    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None, log_level: str = "INFO") -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.outputs = self.ctx.socket(zmq.PULL)
        self._ipc_dir, self.proc = spawn_core(config, self.inputs, self.outputs, env, log_level)
        self.info: dict[str, Any] = {}
        self._streams: dict[str, asyncio.Queue[EngineCoreOutput]] = {}  # {request_id: its outputs}
        self._replies: dict[int, asyncio.Future] = {}  # {nonce: reply future}
        self._nonce = itertools.count()
        self._reader: asyncio.Task | None = None
        self.dead = False

    async def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait for the core's READY (model loaded), then start routing outputs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineCoreError(f"engine core exited with code {self.proc.returncode} during start-up")
            if await self.outputs.poll(100):
                message = messages.decode(await self.outputs.recv())
                if message["type"] == messages.READY:
                    self.info = message["info"]
                    self._reader = asyncio.create_task(self._read_outputs(), name="core-outputs")
                    return self.info
        raise EngineCoreError(f"engine core not ready after {timeout_s:.0f}s")

    async def _read_outputs(self) -> None:
        while True:
            if not await self.outputs.poll(500):
                if self.proc.poll() is not None:
                    self._on_core_death()
                    return
                continue
            try:
                message = messages.decode(await self.outputs.recv())
            except ValueError as exc:
                logger.error("bad message from engine core: %s", exc)
                continue
            if message["type"] == messages.OUTPUTS:
                for data in message["outputs"]:
                    output = messages.output_from_dict(data)
                    queue = self._streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif message["type"] == messages.STATS_REPLY:
                future = self._replies.pop(message.get("nonce"), None)
                if future is not None and not future.done():
                    future.set_result(message)

    def _on_core_death(self) -> None:
        """Fail every open stream: the core process exited under us."""
        self.dead = True
        logger.error("engine core exited with code %s", self.proc.returncode)
        for request_id, queue in self._streams.items():
            queue.put_nowait(
                EngineCoreOutput(request_id, [], finish_reason="error", stop_reason="engine core died")
            )
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineCoreError("engine core died"))

    # ------------------------------------------------------------------ requests

    def open_stream(self, request_id: str) -> asyncio.Queue[EngineCoreOutput]:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> None:
        await self._send(add_request_message(request_id, prompt_token_ids, sampling_params, kv_transfer_params, priority))

    async def abort(self, request_ids: list[str]) -> None:
        await self._send({"type": messages.ABORT, "request_ids": list(request_ids)})

    async def call(self, kind: str, timeout_s: float = 10.0) -> dict[str, Any]:
        nonce = next(self._nonce)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[nonce] = future
        await self._send({"type": kind, "nonce": nonce})
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._replies.pop(nonce, None)

    async def stats(self) -> dict[str, Any]:
        return (await self.call(messages.STATS))["stats"]

    async def _send(self, message: dict[str, Any]) -> None:
        if self.dead or self.proc.poll() is not None:
            raise EngineCoreError("engine core is not running")
        await self.inputs.send(messages.encode(message))

    async def close(self, timeout_s: float = 10.0) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                await self.inputs.send(messages.encode({"type": messages.SHUTDOWN}), zmq.NOBLOCK)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
