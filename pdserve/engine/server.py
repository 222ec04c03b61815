"""The gRPC engine server shared by both roles: ``pdserve prefill`` and ``pdserve decode``.

A thin servicer (as in grpcio's examples): validate, translate into engine-core calls, map
failures to status codes. Beside it: the standard health service (SERVING once the model is
loaded, NOT_SERVING if the core dies), server reflection, and Prometheus ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.config import (
    DTYPE_CHOICES,
    HANDOVER_STEPS,
    KV_TRANSPORTS,
    QUANTIZATION_CHOICES,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    default_dtype,
    default_quantization,
)
from pdserve.engine.core_client import AsyncEngineCoreClient, EngineCoreError
from pdserve.engine.cpu_resources import allowed_cpus, parse_cpu_list
from pdserve.engine.front_session import FrontSession
from pdserve.engine.metrics import EngineMetrics
from pdserve.engine.output_wire import error_status, response_fields
from pdserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pdserve.engine.request import SamplingParams, validate_prompt
from pdserve.engine.session_stream import SessionListener
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.wire import engine_stats_to_proto, kv_params_from_proto, sampling_from_proto

logger = logging.getLogger(__name__)

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
# gRPC refuses larger messages itself (RESOURCE_EXHAUSTED); a prompt is far smaller than this.
MAX_MESSAGE_BYTES = 16 << 20
SHUTDOWN_GRACE_S = 5.0
# SIGTERM waits this long at most for running requests and leases (default lease: 30 s).
DEFAULT_DRAIN_TIMEOUT_S = 45.0
# A scrape waits this long for the core's stats (a busy step is tens of milliseconds).
SCRAPE_TIMEOUT_S = 5.0


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, core: AsyncEngineCoreClient, role: str, address: str, metrics: EngineMetrics) -> None:
        self.core = core
        self.role = role
        self.address = address
        self.metrics = metrics
        assert core.info is not None, "start the core client first"
        self.info = core.info
        self.vocab_size = core.info.vocab_size
        self.max_model_len = core.info.max_model_len
        self.draining = False  # SIGTERM: refuse new requests, finish the running ones
        self.sessions: set[FrontSession] = set()  # open Session RPCs (a drain ends them)
        self.session_port = 0  # of the framed Session stream (``session_stream``); 0: none

    def draining_message(self) -> str:
        return f"{self.role} engine {self.address} is draining"

    async def start_draining(self) -> None:
        """Refuse new requests from now on; a session with nothing left running ends, so that
        the server can stop without waiting for its grace period (the core does the same with
        the framed sessions it serves)."""
        self.draining = True
        for session in self.sessions:
            session.wake.set()
        with contextlib.suppress(EngineCoreError):
            await self.core.start_draining(self.draining_message())

    def _validate(
        self, request: engine_pb2.EngineGenerateRequest
    ) -> tuple[str, list[int], SamplingParams, dict | None]:
        """The request's id, prompt, sampling and KV params; ``_Refused`` when it cannot run
        here (draining, bad input, an id already running)."""
        if self.draining:
            # The router marks this engine down and sends the request elsewhere.
            raise _Refused(grpc.StatusCode.UNAVAILABLE, self.draining_message())
        request_id = request.request_id or f"eng-{uuid.uuid4().hex}"
        prompt = list(request.prompt_token_ids)
        try:
            sampling = sampling_from_proto(request.sampling, request.num_prior_output_tokens)
            sampling.validate(self.vocab_size)
            validate_prompt(prompt, self.max_model_len, self.vocab_size, sampling.num_prior_output_tokens)
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self.core.has_stream(request_id):
            raise _Refused(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running")
        return request_id, prompt, sampling, kv_params_from_proto(request.kv_transfer_params)

    async def Generate(self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext):
        front_events = {"front_received": time.time()}  # sent with the first message
        try:
            request_id, prompt, sampling, kv_params = self._validate(request)
        except _Refused as exc:
            await context.abort(exc.code, exc.message)
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self.core.open_stream(request_id, queue)
        finished = False
        try:
            await self.core.add_request(request_id, prompt, sampling, kv_params, request.priority)
            logger.info(
                "%s: queued (%d prompt tokens, remote KV: %s)", request_id, len(prompt), bool(kv_params)
            )
            while True:
                output = await queue.get()
                if output.finish_reason == "error":
                    finished = True
                    await context.abort(*error_status(str(output.stop_reason)))
                finished = output.finished
                timeline = {**front_events, **(output.timeline or {})}
                front_events = {}
                yield _response(output, timeline)
                if finished:
                    logger.info("%s: finished (%s)", request_id, output.finish_reason)
                    return
        except EngineCoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine core unavailable: {exc}")
        finally:
            self.core.close_stream(request_id)
            if not finished:
                # The caller went away (cancel, deadline, disconnect): free the request's blocks.
                logger.info("%s: cancelled by the caller, aborting", request_id)
                with contextlib.suppress(EngineCoreError):
                    await self.core.abort([request_id])

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext):
        """Requests and aborts in; each step's outputs of all of them out as one message
        (``front_session``). Each request behaves as a ``Generate`` call: the same checks and
        status codes (as a ``RequestError``), and the same abort when the stream ends first.
        Closing this generator early is the router going away, which aborts what is left.
        (The framed stream carries the same messages, served by the core: ``core_sessions``.)"""
        session = FrontSession()
        self.sessions.add(session)
        reader = asyncio.create_task(self._read_session(request_iterator, session))
        try:
            while True:
                await session.wake.wait()
                outputs, errors, aborted = session.take()
                if outputs or errors or aborted:
                    yield self._session_response(session, outputs, errors, aborted)
                if (reader.done() or self.draining) and not session.requests:
                    if reader.done():
                        reader.result()  # a failed read ends the stream with its error
                    return  # the router closed its side (or a drain) and nothing is left to answer
        finally:
            self.sessions.discard(session)
            reader.cancel()
            left = list(session.requests)
            for request_id in left:
                self.core.close_stream(request_id)
            if left:
                # The router went away (or cancelled the stream): free the requests' blocks.
                logger.info("session closed with %d requests running, aborting: %s", len(left), left)
                with contextlib.suppress(EngineCoreError):
                    await self.core.abort(left)

    async def _read_session(self, request_iterator: Any, session: FrontSession) -> None:
        try:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "generate":
                    await self._start_in_session(message.generate, session)
                elif message.WhichOneof("kind") == "abort_request_id":
                    request_id = message.abort_request_id
                    # Answered in the next message even when it had ended here already (the
                    # router cannot tell), which also wakes a draining session to end.
                    if session.abort(request_id):
                        self.core.close_stream(request_id)
                        logger.info("%s: aborted by the router", request_id)
                        with contextlib.suppress(EngineCoreError):
                            await self.core.abort([request_id])
        finally:
            session.wake.set()  # the writer checks whether the session is over

    async def _start_in_session(
        self, request: engine_pb2.EngineGenerateRequest, session: FrontSession
    ) -> None:
        try:
            request_id, prompt, sampling, kv_params = self._validate(request)
        except _Refused as exc:
            session.refuse(request.request_id, exc.code.value[0], exc.message)
            return
        session.add(request_id)
        self.core.open_stream(request_id, session)
        try:
            await self.core.add_request(request_id, prompt, sampling, kv_params, request.priority)
        except EngineCoreError as exc:
            self.core.close_stream(request_id)
            session.fail(request_id, grpc.StatusCode.UNAVAILABLE.value[0], f"engine core unavailable: {exc}")
            return
        logger.info("%s: queued (%d prompt tokens, remote KV: %s)", request_id, len(prompt), bool(kv_params))

    def _session_response(
        self,
        session: FrontSession,
        outputs: list[EngineCoreOutput],
        errors: list[engine_pb2.RequestError],
        aborted: list[str],
    ) -> engine_pb2.SessionResponse:
        response = engine_pb2.SessionResponse(errors=errors, aborted=aborted)
        for output in outputs:
            request_id = output.request_id
            if request_id not in session.requests:
                # Ended earlier in this batch (a step's outputs can follow its final or error
                # output when several core messages were read at once): nothing more to send.
                continue
            if output.finish_reason == "error":
                code, message = error_status(str(output.stop_reason))
                self.core.close_stream(request_id)
                session.requests.pop(request_id, None)
                response.errors.append(
                    engine_pb2.RequestError(request_id=request_id, code=code.value[0], message=message)
                )
                continue
            events = session.requests[request_id]
            timeline = {**events, **(output.timeline or {})} if events else output.timeline
            session.requests[request_id] = {}
            response.outputs.add(**response_fields(output, timeline))
            if output.finished:
                self.core.close_stream(request_id)
                del session.requests[request_id]
                logger.info("%s: finished (%s)", request_id, output.finish_reason)
        return response

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        found = self.core.has_stream(request.request_id)
        try:
            # Taken in by the core before the answer: the router may reuse the id at once, on
            # a framed session the core reads in no order with this front's messages.
            await self.core.abort_taken([request.request_id])
        except (EngineCoreError, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return common_pb2.AbortResponse(found=found)

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        try:
            stats = await self.core.stats()
        except (TimeoutError, EngineCoreError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine core unavailable: {exc}")
        return engine_stats_to_proto(stats, self.role, self.address, healthy=not self.core.dead)

    async def Info(self, request: engine_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        info = self.info
        connector = info.connector or {}
        return engine_pb2.EngineInfo(
            role=self.role,
            model=str(self.core.config.model.path or "bundled:SmolLM2-135M-Instruct"),
            vocab_size=self.vocab_size,
            eos_token_id=info.eos_token_id if info.eos_token_id is not None else -1,
            max_model_len=self.max_model_len,
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            engine_id=str(connector.get("engine_id", "")),
            kv_transport=str(connector.get("transport") or ""),
            dtype=info.dtype,
            torch_threads=info.torch_threads,
            cpus=info.cpus,
            quantization=info.quantization,
            weights=info.weights,
            weight_bytes=info.weight_bytes,
            instance_id=info.instance_id,
            kv_events_port=info.kv_events_port,
            kv_events_replay_port=info.kv_events_replay_port,
            session_port=self.session_port,
        )


class _Refused(Exception):
    """A request this engine will not run, with the status to end it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _response(
    output: EngineCoreOutput, timeline: dict[str, float] | None
) -> engine_pb2.EngineGenerateResponse:
    return engine_pb2.EngineGenerateResponse(**response_fields(output, timeline))


def _hand_to(core: AsyncEngineCoreClient) -> Callable[[socket.socket], object]:
    """Where the session listener sends each router's framed session: to the core, while it runs."""

    def take(connection: socket.socket) -> object:
        if core.dead:
            raise OSError("the engine core is gone")
        return core.open_session(connection)

    return take


async def _watch_core(core: AsyncEngineCoreClient, health_servicer: Any) -> None:
    """Flip health to NOT_SERVING when the core process dies (told by the core client, with no
    wake-up until then)."""
    await core.died.wait()
    logger.error("engine core is gone: reporting NOT_SERVING")
    for service in ("", ENGINE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


def _stats_from(
    core: AsyncEngineCoreClient, loop: asyncio.AbstractEventLoop
) -> Callable[[], SchedulerStats | None]:
    """The core's scheduler stats, asked from another thread (a metrics scrape) through the
    loop that owns the core client; None once the core is gone or the loop has closed."""

    def stats() -> SchedulerStats | None:
        if core.dead or loop.is_closed():
            return None
        asking = core.stats(timeout_s=SCRAPE_TIMEOUT_S)
        try:
            asked = asyncio.run_coroutine_threadsafe(asking, loop)
        except RuntimeError:  # the loop closed meanwhile
            asking.close()
            return None
        return asked.result(timeout=SCRAPE_TIMEOUT_S + 1.0)  # a loop that does not answer at all

    return stats


async def drain(
    core: AsyncEngineCoreClient,
    servicer: EngineServicer,
    health_servicer: Any,
    timeout_s: float,
    cut_short: asyncio.Event,
) -> None:
    """Leave the rotation at once (health NOT_SERVING, new requests UNAVAILABLE), then wait
    until nothing runs, waits or is held for a remote reader (a prefill's leases end when
    decode has pulled the blocks, or expire), for at most ``timeout_s``."""
    await servicer.start_draining()
    for service in ("", ENGINE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    logger.info("draining (at most %.0fs): NOT_SERVING, new requests refused", timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not core.dead and not cut_short.is_set():
        try:
            stats = await core.stats()
        except (EngineCoreError, TimeoutError):
            break
        busy = {
            "running": stats.num_running_reqs,
            "waiting": stats.num_waiting_reqs,
            "waiting_for_remote_kvs": stats.num_waiting_for_remote_kvs,
            "held_blocks": stats.num_held_blocks,
        }
        if not any(busy.values()):
            logger.info("drained: nothing running or held")
            return
        if loop.time() > deadline:
            logger.warning("drain timed out after %.0fs with %s", timeout_s, busy)
            return
        await asyncio.sleep(0.1)
    logger.warning("drain cut short")


async def serve_engine(
    config: EngineConfig,
    role: str,
    host: str,
    port: int,
    metrics_port: int | None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    session_port: int = 0,
) -> None:
    """Serve until SIGTERM / SIGINT, then drain. ``session_port``: where routers may open
    their Session stream without gRPC (0: a free port, announced in ``Info``; -1: none)."""
    core = AsyncEngineCoreClient(config)
    try:
        await core.start()
    except EngineCoreError:
        await core.close()
        raise
    address = f"{host}:{port}"
    metrics = EngineMetrics(role, address)
    info = core.info
    assert info is not None  # set by start()
    metrics.weight_bytes.set(info.weight_bytes)
    logger.info(
        "%s engine weights: %s (--quantization %s), %.1f MB",
        role,
        info.weights,
        info.quantization,
        info.weight_bytes / 1e6,
    )
    if metrics_port is not None:
        metrics.serve(host, metrics_port, _stats_from(core, asyncio.get_running_loop()))
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a port clash must fail loudly, not share the port
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    servicer = EngineServicer(core, role, address, metrics)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ENGINE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    server.add_insecure_port(address)
    await server.start()
    session_server = None
    if session_port >= 0:
        session_server = SessionListener(host, session_port, _hand_to(core))
        servicer.session_port = session_server.port
        logger.info("%s engine: Session stream on port %d", role, servicer.session_port)
    for service in ("", ENGINE_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("%s engine serving on %s (metrics on %s)", role, address, metrics_port)
    print(f"pdserve {role} engine ready on {address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_watch_core(core, health_servicer))
    await stop.wait()
    stop.clear()  # a second SIGTERM / Ctrl-C cuts the drain short
    if session_server is not None:
        session_server.close()  # no new sessions; the open ones end with the drain
    await drain(core, servicer, health_servicer, drain_timeout_s, stop)
    await server.stop(SHUTDOWN_GRACE_S)
    watcher.cancel()
    await core.close()


# ---------------------------------------------------------------------- command line


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (gRPC, metrics, KV side channel)")
    parser.add_argument(
        "--advertise-host", default=None, help="address peers use to reach this engine's KV (default: --host)"
    )
    parser.add_argument("--port", type=int, required=True, help="gRPC port")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    parser.add_argument(
        "--session-port",
        type=int,
        default=0,
        help="port of the router's Session stream without gRPC (the same messages, framed on TCP: "
        "less CPU a token on both ends); 0 (the default): a free port, announced to routers by the "
        "Info RPC; -1: none, routers use the Session RPC",
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)"
    )
    parser.add_argument(
        "--dtype",
        default=default_dtype(),
        choices=list(DTYPE_CHOICES),
        help="auto (the default; $PDSERVE_DTYPE changes it): bfloat16 where the CPU has native bf16 "
        "(AVX512-BF16, AMX, Arm BF16), else float32",
    )
    parser.add_argument(
        "--quantization",
        default=default_quantization(),
        choices=list(QUANTIZATION_CHOICES),
        help="how the weights are held: auto (the default; $PDSERVE_QUANTIZATION changes it): for a "
        "GGUF file where the quantized kernels build, on every engine, gguf-a8 where the CPU has "
        "AVX512-VNNI and gguf elsewhere, else none; none (dense "
        "in --dtype); gguf (a GGUF file's blocks kept as they are, every common kind: 4.5-8.5 bits a "
        "weight); int8 (Q8_0 blocks made at load from any checkpoint); gguf-a8 / int8-a8 (the same "
        "weights, the matmuls' activations quantized to int8 per 32). The KV cache stays in --dtype",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the engine core (default: $OMP_NUM_THREADS if set, else the CPUs the "
        "process may use: its affinity and cgroup CPU quota, whichever is smaller)",
    )
    parser.add_argument(
        "--core-cpus",
        type=parse_cpu_list,
        default=None,
        help='pin the engine core (model steps, torch threads) to these cpus ("1", "2-3"); the '
        "front (gRPC, streaming) runs wherever this process may. pdserve cluster passes each "
        "engine its share, so that token streaming does not take a decode engine's cycles",
    )
    parser.add_argument(
        "--cpu-board",
        default=None,
        metavar="PATH:SLOT",
        help="the cpu board this engine shares with the other engines of the machine, and its "
        "slot there: it borrows their cores while they are idle and lends its own (pdserve "
        "cluster passes it; see pdserve.engine.cpu_lending)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step (default 2048; a prefill engine's default is 512, see pdserve.prefill.server)",
    )
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--engine-id", default="", help="stable id of this engine (default: random)")
    parser.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS))
    parser.add_argument("--kv-port", type=int, default=0, help="KV side-channel port (0: pick one)")
    parser.add_argument("--lease-ms", type=int, default=30_000)
    parser.add_argument("--transfer-timeout-s", type=float, default=10.0)
    parser.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    parser.add_argument(
        "--handover-step",
        default="inflight",
        choices=list(HANDOVER_STEPS),
        help="decode: run a request whose KV just landed in the step in flight when that step is "
        "at most half done (inflight, the default: its row runs the missed layers alone, then "
        "goes on with the batch), in the next batch step (joined, as vLLM), or first in a small "
        "step of its own (separate: a faster second token, a slower next token for the running "
        "requests)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds to finish running requests and leases before exiting",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish KV-cache events (vLLM's wire format) on a ZMQ PUB socket on this port, with "
        "a replay socket on the next one; 0 picks free ports, which Info reports (default: off)",
    )
    parser.add_argument(
        "--cluster-token", default=None, help="HMAC key for the KV side channel (or PDSERVE_CLUSTER_TOKEN)"
    )


def engine_config_from_args(args: argparse.Namespace, kv_role: str | None) -> EngineConfig:
    import os

    token = args.cluster_token or os.environ.get("PDSERVE_CLUSTER_TOKEN") or None
    outside = sorted(set(args.core_cpus or ()) - set(allowed_cpus()))
    if outside:
        raise ValueError(
            f"--core-cpus names cpus {outside} this process may not use (it may use {allowed_cpus()})"
        )
    board_path, board_slot = None, 0
    if args.cpu_board:
        path, sep, slot = args.cpu_board.rpartition(":")
        if not sep or not path or not slot.isdigit():
            raise ValueError(f"--cpu-board takes PATH:SLOT, got {args.cpu_board!r}")
        board_path, board_slot = path, int(slot)
    kv = None
    if kv_role is not None:
        kv = KVTransferConfig(
            role=kv_role,
            transport=args.kv_transport,
            engine_id=args.engine_id,
            host=args.host,
            advertise_host=args.advertise_host,
            side_channel_port=args.kv_port,
            lease_ms=args.lease_ms,
            transfer_timeout_s=args.transfer_timeout_s,
            cluster_token=token,
        )
    return EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, quantization=args.quantization),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            kv_load_failure_policy=args.kv_load_failure_policy,
            handover_step=args.handover_step,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        kv_transfer=kv,
        threads=args.threads,
        core_cpus=args.core_cpus,
        cpu_board=board_path,
        cpu_board_slot=board_slot,
        kv_events=KVEventsConfig(host=args.host, port=args.kv_events_port)
        if args.kv_events_port is not None
        else None,
    )


def run_engine_server(args: argparse.Namespace, role: str, kv_role: str | None) -> int:
    from pdserve.engine.model.tokenizer import check_tokenizer

    try:
        config = engine_config_from_args(args, kv_role)
        # A tokenizer that cannot be built ends the start here, in one line, before the engine
        # core reads any weight (the router refuses such a model the same way).
        check_tokenizer(config.model.path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(
            serve_engine(
                config, role, args.host, args.port, args.metrics_port, args.drain_timeout, args.session_port
            )
        )
    except EngineCoreError as exc:
        logger.error("%s engine failed to start: %s", role, exc)
        return 1
    return 0
