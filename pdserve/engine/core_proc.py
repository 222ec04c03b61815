"""The engine core process: ``python -m pdserve.engine.core_proc`` (EngineConfig JSON on stdin).

Connects to the front's two ZMQ IPC sockets (inputs, outputs), loads the model, reports READY
and runs ``EngineCore.run_busy_loop``. It exits when told to, or when its parent process dies,
so a killed front never leaves a core holding memory.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import socket
import sys
import uuid
from typing import Any

import zmq

from pdserve.config import EngineConfig
from pdserve.engine import messages
from pdserve.engine.core import AbortRequests, EngineCore, EngineCoreRequest
from pdserve.engine.core_sessions import CoreSessions
from pdserve.engine.cpu_lending import CpuBoard, LentThreads
from pdserve.engine.cpu_resources import allowed_cpus, configure_torch_threads, format_cpu_list, pin_threads
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.engine.model.arch import UnsupportedModelError
from pdserve.engine.model.gguf_tokenizer import UnsupportedTokenizerError
from pdserve.engine.outputs import EngineCoreOutput

logger = logging.getLogger("pdserve.core")


def build_engine_core(config: EngineConfig) -> EngineCore:
    """The model loaded in the resolved dtype, its KV cache in the same dtype, the connector."""
    from pdserve.engine.model.loader import load_served_model

    kv_role = config.kv_transfer.role if config.kv_transfer is not None else "both"
    loaded = load_served_model(config.model, kv_role)
    connector = None
    if config.kv_transfer is not None:
        from pdserve.connector.factory import create_connector

        spec = loaded.arch.kv_cache_spec(config.cache.block_size, loaded.dtype)
        connector = create_connector(config.kv_transfer, spec, weights=loaded.weights)
    return EngineCore(loaded, config.scheduler, config.cache, connector, kv_cache_dtype=loaded.dtype)


class CoreServer:
    """Translates ZMQ messages to EngineCore calls and outputs back to messages; routers'
    framed sessions are read and written here (``CoreSessions``)."""

    def __init__(
        self,
        core: EngineCore,
        input_addr: str,
        output_addr: str,
        parent_pid: int,
        session_channel: socket.socket | None = None,
    ) -> None:
        self.core = core
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PULL)
        self.inputs.connect(input_addr)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)
        self.sessions = CoreSessions(session_channel) if session_channel is not None else None
        if self.sessions is not None:
            self.poller.register(self.sessions.channel.fileno(), zmq.POLLIN)
        self._polled: dict[int, int] = {}  # {session fd: the poll flags it is registered with}
        self.counts = OutputCounts()
        # Taken when the process started, not after the model loaded: a front that died during
        # the load has already handed this process to init, whose pid must not pass for it.
        self.parent_pid = parent_pid
        self.stopping = False

    def send(self, message: messages.CoreMessage) -> None:
        self.outputs.send(messages.encode(message))

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        self.counts.add(outputs)
        if self.sessions is not None:
            outputs = self.sessions.route(outputs)
            self.sessions.flush_messages()
        if outputs:
            self.send(messages.Outputs(outputs))

    def receive(self, timeout: float | None) -> list[Any]:
        if os.getppid() != self.parent_pid:
            logger.warning("front process is gone; shutting down")
            self.stopping = True
            return []
        items: list[Any] = []
        sessions = self.sessions
        if sessions is not None:
            items.extend(sessions.take_lost())
        wait_ms = None if timeout is None else int(timeout * 1000)
        while True:
            self._update_poll()
            events = dict(self.poller.poll(wait_ms))
            if not events:
                return items
            wait_ms = 0
            if sessions is not None:
                if sessions.channel.fileno() in events and not sessions.accept():
                    logger.warning("front process is gone (its session channel closed); shutting down")
                    self.stopping = True
                    return items
                for fd in self._polled.keys() & events.keys():
                    if events[fd] & zmq.POLLOUT:
                        sessions.flush_pending()  # a router took some of what it was behind on
                    if events[fd] & (zmq.POLLIN | zmq.POLLERR):
                        items.extend(sessions.read(fd))
                items.extend(sessions.take_lost())
            if self.inputs not in events:
                continue
            try:
                item = self._translate(messages.decode_from_front(self.inputs.recv()))
            except ValueError as exc:
                logger.warning("dropped malformed input: %s", exc)
                continue
            if item is not None:
                items.append(item)

    def _update_poll(self) -> None:
        """Wake up for every session's input, and for its socket's room while bytes wait to go."""
        if self.sessions is None:
            return
        wanted: dict[int, int] = dict.fromkeys(self.sessions.readable(), int(zmq.POLLIN))
        for fd in self.sessions.waiting_to_write():
            wanted[fd] = int(zmq.POLLIN | zmq.POLLOUT)
        if wanted == self._polled:
            return
        for fd in self._polled.keys() - wanted.keys():
            self.poller.unregister(fd)
        for fd, flags in wanted.items():
            if self._polled.get(fd) != flags:
                self.poller.register(fd, flags)  # registering again changes the flags
        self._polled = wanted

    def _translate(self, message: messages.FrontMessage) -> EngineCoreRequest | AbortRequests | None:
        """The loop's input for a request or an abort; queries are answered here (None)."""
        if isinstance(message, messages.AddRequest):
            return EngineCoreRequest(
                request_id=message.request_id,
                prompt_token_ids=message.prompt_token_ids,
                sampling_params=message.sampling_params,
                arrival_time=message.arrival_time,
                priority=message.priority,
                kv_transfer_params=message.kv_transfer_params,
            )
        if isinstance(message, messages.Abort):
            return AbortRequests(message.request_ids)
        if isinstance(message, messages.AbortTaken):
            self.send(messages.AbortTakenReply(nonce=message.nonce))
            return AbortRequests(message.request_ids)
        if isinstance(message, messages.Drain):
            if self.sessions is not None:
                self.sessions.start_draining(message.message)
        elif isinstance(message, messages.StatsQuery):
            stats = self.core.stats()
            stats.num_generated_tokens = self.counts.tokens
            stats.num_finished = dict(self.counts.finished)
            self.send(messages.StatsReply(nonce=message.nonce, stats=stats))
        elif isinstance(message, messages.ResetPrefixCache):
            ok = self.core.scheduler.reset_prefix_cache()
            self.send(messages.ResetPrefixCacheReply(nonce=message.nonce, ok=ok))
        elif isinstance(message, messages.Shutdown):
            self.stopping = True
        return None

    def serve(self) -> None:
        self.core.run_busy_loop(self.receive, self.emit, lambda: self.stopping)

    def close(self) -> None:
        if self.sessions is not None:
            self.sessions.close_all()
        self.core.shutdown()
        self.inputs.close(linger=0)
        self.outputs.close(linger=1000)
        self.ctx.term()


class OutputCounts:
    """Tokens generated and requests finished by reason, every request of the engine counted
    here once (the front's metrics read them at a scrape): the core sees every output, the
    front only those of requests it started."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()

    def add(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            self.tokens += len(output.new_token_ids)
            # An error is not a finish (a refused request, a failed step: the status says why).
            if output.finish_reason is not None and output.finish_reason != "error":
                self.finished[output.finish_reason] += 1


SWITCH_INTERVAL_S = 0.0005


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process to ``cpus``: the ones started by imports already (the
    mask is per thread), and through the main thread's mask every one started later (torch's
    pool, ZMQ's I/O thread)."""
    pin_threads(cpus)
    os.sched_setaffinity(0, cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-core")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--parent-pid", type=int, required=True, help="the front's pid")
    parser.add_argument(
        "--session-channel", type=int, default=-1, help="fd of the Unix socket the front hands sessions on"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s core[%(process)d] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The KV transfer thread must get the GIL promptly while a step runs Python between its
    # torch ops: a 5 ms default switch interval was up to 5 ms of queueing on every pull.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # The front that spawned this core (see CoreServer.receive), as the front said: os.getppid()
    # asked here, after this module's imports (seconds of torch), is init's pid already when the
    # front died meanwhile, and an idle core then outlived it, holding its model and cache.
    parent_pid = args.parent_pid
    if os.getppid() != parent_pid:
        logger.warning("front process %d is gone before this core started; exiting", parent_pid)
        return 0
    config = EngineConfig.from_json(sys.stdin.read())  # see core_client.spawn_core
    server = None
    lent: LentThreads | None = None
    board: CpuBoard | None = None
    try:
        if config.core_cpus is not None:
            pin_process(config.core_cpus)
        # Before any torch work: threads sized to this process's CPUs, not the machine's.
        threads = configure_torch_threads(config.threads)
        if config.cpu_board:
            try:
                board = CpuBoard(config.cpu_board, config.cpu_board_slot)
            except (OSError, ValueError) as exc:
                logger.error("cpu board %s unusable, so no core lending: %s", config.cpu_board, exc)
            else:
                board.set_busy(True)  # loading and warming up: its cores are not lendable yet
        try:
            core = build_engine_core(config)
        except (UnsupportedModelError, UnsupportedTokenizerError) as exc:
            # A model this engine cannot serve is one line, not a traceback of the loader.
            logger.error("cannot serve %s: %s", config.model.path or "the bundled model", exc)
            return 1
        if board is not None:
            # After the load, so that it ran on the engine's own threads alone.
            lent = LentThreads(board, threads)
            lent.idle()  # loaded: lendable until its first step
            core.lent_threads = lent
        if config.kv_events is not None:
            core.attach_kv_events(
                KVEventPublisher(
                    config.kv_events.host,
                    config.kv_events.port,
                    config.kv_events.replay_port,
                    config.kv_events.buffer_steps,
                )
            )
        channel = socket.socket(fileno=args.session_channel) if args.session_channel >= 0 else None
        server = CoreServer(core, args.input, args.output, parent_pid, channel)
        info = messages.CoreInfo(
            vocab_size=core.vocab_size,
            eos_token_id=core.eos_token_id,
            max_model_len=config.scheduler.max_model_len,
            num_blocks=config.cache.num_blocks,
            block_size=config.cache.block_size,
            connector=core.connector.describe() if core.connector is not None else None,
            dtype=core.kv_cache_spec.dtype,
            torch_threads=threads,
            cpus=format_cpu_list(allowed_cpus()),
            quantization=core.loaded.quantization,
            weights=core.loaded.weights,
            weight_bytes=core.loaded.weight_bytes,
            instance_id=uuid.uuid4().hex,
            kv_events_port=core.kv_events.port if core.kv_events is not None else 0,
            kv_events_replay_port=core.kv_events.replay_port if core.kv_events is not None else 0,
        )
        server.send(messages.Ready(info))
        logger.info("engine core ready (%s)", info)
        server.serve()
    finally:
        if server is not None:
            server.close()
        if lent is not None:
            lent.close()  # its cores are lendable again
        elif board is not None:
            board.set_busy(False)
            board.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
