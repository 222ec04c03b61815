"""The router's gRPC service: validate, route to prefill then decode, stream, abort.

A request's path: tokenize and validate; pick a prefill engine (policy) and ask it for the
first token with ``do_remote_decode``; stream that token to the client at once (TTFT does not
wait for the KV transfer); pick a decode engine and send it the prompt + first token + the
prefill's ``kv_transfer_params``; stream decode's tokens. A prompt whose uncached part is short
goes straight to a decode engine (conditional disaggregation), and so does any prompt while
every prefill engine is backlogged and a decode engine is prefilling nothing itself
(``--max-prefill-queue``, conditional disaggregation by load). Whatever ends the request early
(client cancel, deadline, an engine failure) aborts it on every engine it touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol, cast

import grpc

from pdserve.engine.kv_cache import hash_request_blocks
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.engine.request import SamplingParams, validate_prompt
from pdserve.router.engine_session import SessionStream
from pdserve.router.engines import EngineHandle, EnginePool
from pdserve.router.metrics import RouterMetrics, observe_many
from pdserve.router.policies import RoutingPolicy
from pdserve.router.text import TextStream
from pdserve.router.token_relay import Relayed, TokenRelay
from pdserve.router.trace import TraceLog
from pdserve.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from pdserve.wire import sampling_from_proto, sampling_to_proto

logger = logging.getLogger(__name__)

# A prompt (text) longer than this many bytes is refused before tokenizing it.
MAX_PROMPT_BYTES = 1 << 20
ENGINE_RPC_TIMEOUT_S = 600.0
CHAT_ROLES = ("system", "user", "assistant")
# How many times one request's decode may move to another engine after its engine went away.
MAX_DECODE_RESUMES = 2


class RouterError(Exception):
    """Ends a request with a status code (raised inside the request path).

    ``resumable``: the engine went away with the request unfinished, so another engine of the
    same role can go on with it.
    """

    def __init__(self, code: grpc.StatusCode, message: str, resumable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.resumable = resumable


@dataclass
class PreparedRequest:
    """A validated request, ready to route: what both front doors (gRPC and HTTP) hand the
    one request path."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False


@dataclass
class LiveRequest:
    request_id: str
    arrival: float  # perf_counter, for durations
    # {"<where>.<event>": unix time}: the router's and the engines' life-cycle events.
    timeline: dict[str, float] = field(default_factory=lambda: {"router.receive": time.time()})
    engines: list[EngineHandle] = field(default_factory=list)  # every engine it was sent to
    calls: list = field(default_factory=list)  # its engine streams in flight (cancelled on abort)
    aborted: bool = False
    cut_short: bool = False  # ended by the router (a stop string) while engines still hold it
    # {role: prompt blocks the router expected the picked engine's prefix cache to hold}
    expected_hit_blocks: dict[str, int] = field(default_factory=dict)

    def abort(self) -> None:
        """Stop relaying now: cancel every engine stream (each engine then frees the request)."""
        self.aborted = True
        for call in self.calls:
            call.cancel()


class TokenSink(Protocol):
    """Where a front door takes a streamed answer's plain tokens straight from the engine
    session's reader (``SessionStream.deliver``), past the request path's generators. Only the
    tokens between a stage's first and last message come here; those go through ``run``."""

    def ready(self) -> bool:
        """True when ``tokens`` can send at once (the client reads, and is there)."""
        ...

    def tokens(self, text: str, token_ids: list[int]) -> None:
        """Send a token's text delta (possibly empty: a character still incomplete)."""
        ...

    def relay_target(self) -> tuple[int, bytes, bytes] | None:
        """The client's socket and a plain token's chunk around its text, for the C token relay
        (``TokenRelay.register``); None: the relay cannot write this answer's chunks."""
        ...

    def ready_for_relay(self) -> bool:
        """True when the relay may write to the client now (ready, nothing buffered)."""
        ...

    def relayed(self, relayed: Relayed) -> None:
        """Take back what the relay sent (see ``_ChunkSink.relayed``)."""
        ...


class _Aborted(Exception):
    """The client asked (through Abort, or by disconnecting) to end the request."""


# Prompts every prefill engine must have in its prefill stage before a decode engine takes the
# next one whole (``RouterServicer._prefill_backlogged``). Chosen by ``pdserve bench peers`` on
# two cores (see docs/performance.md, bench peers).
DEFAULT_MAX_PREFILL_QUEUE = 4
# Or uncached prompt tokens: 4 of that sweep's 256-token prompts, and one long prompt (which a
# short prompt would otherwise wait a second or more behind: bench peers --scenario long).
DEFAULT_MAX_PREFILL_QUEUE_TOKENS = 1024
# The longest uncached prompt a decode engine takes whole that way: its other streams wait for
# that prefill's step.
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 1024
# A decode engine already prefilling prompts whole takes another only while their uncached tokens
# together stay within this (one prefilling nothing always takes one): two of the long scenario's
# 64-token stream prompts (its streams' longest gap was then 117-182 ms on the Zen 4, within its
# 250 ms SLO), while the 8-stream sweep's 256-token prompts stay one at a time.
DEFAULT_MAX_LOCAL_PREFILL_QUEUE_TOKENS = 128
# Inter-token gaps of a sink's tokens observed together (``RouterServicer._relay``).
ITL_BATCH = 16


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        pool: EnginePool,
        tokenizer: Tokenizer,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        disagg_min_tokens: int,
        max_inflight: int,
        trace: TraceLog | None = None,
        max_prefill_queue: int = 0,
        max_prefill_queue_tokens: int = 0,
        max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
        max_local_prefill_queue_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_QUEUE_TOKENS,
        token_relay: bool = True,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        _ = tokenizer.token_bytes  # built now (~0.1 s for 50k tokens), not in the first request
        # Streaming answers' plain tokens relayed in C where it builds (pdserve.router.token_relay).
        self.token_relay = TokenRelay.load(tokenizer.token_bytes) if token_relay else None
        self.policy = policy
        self.metrics = metrics
        self.disagg_min_tokens = disagg_min_tokens
        self.max_prefill_queue = max_prefill_queue
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_local_prefill_queue_tokens = max_local_prefill_queue_tokens
        self.max_inflight = max_inflight
        self.trace = trace or TraceLog(None)
        self.live: dict[str, LiveRequest] = {}

    # ------------------------------------------------------------------ validation

    def _limits(self) -> tuple[int, int, int]:
        """(vocab_size, max_model_len, block_size) from the engines (the strictest)."""
        # One pass and no generator: a request asks for these several times.
        limits: tuple[int, int, int] | None = None
        for engine in self.pool.engines:
            info = engine.info
            if info is None:
                continue
            if limits is None:
                limits = (info.vocab_size, info.max_model_len, info.block_size)
            else:
                limits = (min(limits[0], info.vocab_size), min(limits[1], info.max_model_len), limits[2])
        if limits is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no engine has come up yet")
        return limits

    def prepare(
        self, request: router_pb2.GenerateRequest, tokens: list[int] | None = None
    ) -> PreparedRequest:
        """Tokenize and validate; ValueError (-> INVALID_ARGUMENT / HTTP 400) names the field.

        ``tokens``: what ``tokenize`` gave for this request already (the HTTP front door looks
        at the prompt's length before it sets a default ``max_tokens``).
        """
        if tokens is None:
            tokens = self.tokenize(request)
        vocab_size = self._limits()[0]
        sampling = sampling_from_proto(request.sampling)  # validated as it is made
        if sampling.stop_token_ids and max(sampling.stop_token_ids) >= vocab_size:
            # The one check that needs the vocabulary: raises, naming the id.
            sampling.validate(vocab_size)
        if any(not s for s in request.stop):
            raise ValueError("stop: a stop string must not be empty")
        return PreparedRequest(
            tokens, sampling, request.priority, tuple(request.stop), request.include_stop_str_in_output
        )

    def tokenize(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The request's prompt tokens, checked; ValueError names the field.

        Chat messages given to a model with no chat template raise ``NoChatTemplateError`` (a
        ValueError saying so, and that a plain prompt works).
        """
        vocab_size, max_model_len, _ = self._limits()
        if bool(request.prompt) + bool(request.prompt_token_ids) + bool(request.messages) > 1:
            raise ValueError("give one of prompt, prompt_token_ids or messages")
        text_bytes = len(request.prompt.encode())
        for message in request.messages:
            text_bytes += len(message.content.encode())
        if text_bytes > MAX_PROMPT_BYTES:
            raise ValueError(f"prompt: {text_bytes} bytes is over the {MAX_PROMPT_BYTES}-byte limit")
        if request.messages:
            for i, message in enumerate(request.messages):
                if message.role not in CHAT_ROLES:
                    raise ValueError(
                        f"messages[{i}].role: {message.role!r} is not one of {', '.join(CHAT_ROLES)}"
                    )
            conversation = [{"role": m.role, "content": m.content} for m in request.messages]
            # Rendered by the model's template (which writes the BOS text itself when the model
            # wants one), then tokenized with no BOS added (vLLM's and llama.cpp's way).
            tokens = self.tokenizer.encode_chat(conversation)
        elif request.prompt and request.apply_chat_template:
            tokens = self.tokenizer.encode_chat([{"role": "user", "content": request.prompt}])
        elif request.prompt:
            # Plain text: the model's add-BOS/EOS rule applies (Gemma's BOS; SmolLM2 adds none).
            tokens = self.tokenizer.encode_prompt(request.prompt)
        else:
            tokens = [int(t) for t in request.prompt_token_ids]
        validate_prompt(tokens, max_model_len, vocab_size)
        return tokens

    def admit(self, request_id: str) -> LiveRequest:
        """Register a request as in flight, or refuse it (ALREADY_EXISTS, RESOURCE_EXHAUSTED)."""
        if request_id in self.live:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running")
        if len(self.live) >= self.max_inflight:
            self.metrics.rejected_by(code="RESOURCE_EXHAUSTED").inc()
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router is at its limit of {self.max_inflight} requests in flight; retry later",
            )
        live = LiveRequest(request_id, time.perf_counter())
        self.live[request_id] = live
        return live

    def healthy(self) -> bool:
        """True while a request can be served (a decode engine is in rotation)."""
        return bool(self.pool.of_role("decode"))

    def max_model_len(self) -> int:
        return self._limits()[1]

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """The gRPC front door: prepare, admit, run; failures become status codes."""
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        try:
            prepared = self.prepare(request)
            live = self.admit(request_id)
        except ValueError as exc:
            self.metrics.rejected_by(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await context.abort(exc.code, str(exc))
        remaining = context.time_remaining()
        try:
            async with contextlib.aclosing(self.run(live, prepared, remaining)) as responses:
                async for response in responses:
                    yield response
        except RouterError as exc:
            await context.abort(exc.code, str(exc))

    async def run(
        self,
        live: LiveRequest,
        prepared: PreparedRequest,
        timeout: float | None = None,
        sink: TokenSink | None = None,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The one request path, behind both front doors: route, stream, and on any early end
        (abort, disconnect, failure, a stop string) abort the request on every engine touched.

        Raises RouterError when the request fails; an abort ends the stream with
        finish_reason "abort". With a ``sink``, a decode stage's plain tokens (not its first
        or last) go to it instead of being yielded, when no stop string is to be watched.
        """
        request_id = live.request_id
        finished = counted = False
        try:
            # Closed at once when we stop early: each stage's in-flight count drops right away.
            # (The request path's generators are closed in ``finally``, as ``contextlib.aclosing``
            # would, without its three calls a layer.)
            responses = self._run(live, prepared, timeout or ENGINE_RPC_TIMEOUT_S, sink)
            try:
                async for response in responses:
                    finished = bool(response.finish_reason)
                    yield response
                    if finished:
                        break
            finally:
                await responses.aclose()
        except _Aborted:
            logger.info("%s: aborted by the client", request_id)
            self.metrics.requests_by(finish_reason="abort").inc()
            counted = True
            yield router_pb2.GenerateResponse(request_id=request_id, finish_reason="abort")
        except RouterError as exc:
            logger.warning("%s: %s", request_id, exc)
            self.metrics.requests_by(finish_reason=exc.code.name.lower()).inc()
            counted = True
            raise
        finally:
            try:
                if not finished and not counted:
                    # The caller went away (gRPC cancel or deadline, HTTP stream closed).
                    logger.info("%s: the client went away", request_id)
                    self.metrics.requests_by(finish_reason="abort").inc()
                if not finished or live.cut_short:
                    # Cancelled, disconnected, failed or cut short by a stop string: engines may
                    # still hold or run it, and nothing may stay allocated anywhere.
                    live.abort()
                    await asyncio.shield(self._abort_on_engines(live))
            finally:
                # Only now may a new request take the id: the aborts above, sent by id, must
                # not reach the engines after it.
                if self.live.get(request_id) is live:
                    del self.live[request_id]

    async def _run(
        self, live: LiveRequest, prepared: PreparedRequest, timeout: float, sink: TokenSink | None
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        tokens, sampling, priority = prepared.prompt_token_ids, prepared.sampling, prepared.priority
        block_size = self._limits()[2]
        block_hashes = hash_request_blocks(tokens, block_size, [])
        timings: dict = {
            "queue_ms": (time.perf_counter() - live.arrival) * 1e3,
            "num_prompt_tokens": len(tokens),
        }
        text = TextStream(
            self.tokenizer, prepared.stop, prepared.include_stop_str_in_output, sampling.min_tokens
        )
        # The engines' sampling message, made once: each stage sends it with its own token counts.
        engine_sampling = sampling_to_proto(sampling)
        prefills = self.pool.of_role("prefill")
        decodes = self.pool.of_role("decode")
        if not decodes:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode engine")
        decode_hit = max(self.policy.expected_blocks(d, block_hashes) for d in decodes) * block_size
        uncached = len(tokens) - decode_hit
        short = uncached < self.disagg_min_tokens
        backlogged = (
            not short
            and bool(prefills)
            and uncached <= self.max_local_prefill_tokens
            and self._prefill_backlogged(prefills, decodes, uncached)
        )
        direct = not prefills or short or backlogged
        self.metrics.routed_by(
            path="backlog_colocated" if backlogged else "colocated" if direct else "disaggregated"
        ).inc()
        if backlogged:
            logger.info(
                "%s: every prefill engine has >= %d prompts or >= %d tokens queued; prefilling on a decode engine",
                live.request_id,
                self.max_prefill_queue,
                self.max_prefill_queue_tokens,
            )

        # What decode starts from: nothing (served colocated on decode), or the prefill's first
        # token and the address of the blocks it holds for decode to pull.
        output: list[int] = []
        kv_params: common_pb2.KVTransferParams | None = None
        prefill_done: float | None = None
        if not direct:
            # Prefill: the first token and the held blocks' address.
            prefill_sampling = _stage_sampling(engine_sampling, 1, min(sampling.min_tokens, 1))
            remote = sampling.max_tokens > 1
            kv = common_pb2.KVTransferParams(do_remote_decode=True) if remote else None
            stage = self._stream_stage(
                live, "prefill", tokens, prefill_sampling, 0, priority, kv, block_hashes, timeout
            )
            first: engine_pb2.EngineGenerateResponse | None = None
            relay = self._relay(live, stage, text, timings, first_stage=True, last_stage=not remote)
            try:
                try:
                    async for response, message in relay:
                        first = message
                        yield response
                        if response.finish_reason:
                            return  # EOS, a stop token or string, max_tokens == 1
                finally:
                    await relay.aclose()
            except RouterError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE or first is not None:
                    raise
                # Every prefill engine failed before answering: serve it colocated on decode.
                logger.warning("%s: %s; falling back to decode alone", live.request_id, exc)
            else:
                if first is None or first.finish_reason != "length":
                    return
                if live.aborted:
                    raise _Aborted()
                prefill_done = time.perf_counter()
                live.timeline["router.prefill_answer"] = time.time()
                output, kv_params = list(first.token_ids), first.kv_transfer_params

        # Decode: colocated, or after the prefill's first token, pulling its blocks.
        decoded = self._decode(
            live,
            tokens,
            output,
            sampling,
            engine_sampling,
            priority,
            kv_params,
            block_hashes,
            timeout,
            text,
            timings,
            prefill_done=prefill_done,
            sink=sink,
        )
        try:
            async for response in decoded:
                yield response
        finally:
            await decoded.aclose()

    def _prefill_backlogged(
        self, prefills: list[EngineHandle], decodes: list[EngineHandle], uncached: int
    ) -> bool:
        """True when a prompt of ``uncached`` tokens is better prefilled on a decode engine: every
        prefill engine has at least ``max_prefill_queue`` prompts, or ``max_prefill_queue_tokens``
        uncached prompt tokens, in its prefill stage (queued or running) and some decode engine
        can take it (``_takes_local_prefill``). Tokens, since a prompt waits for the tokens ahead
        of it: one 1500-token prompt is a second of a core's prefill, which a 64-token prompt
        behind it would wait for (its own prefill on a decode engine holds that engine's streams
        up for one ~35 ms step). As Dynamo's disaggregated router does with its prefill queue: a
        prefill engine is one core's worth of prompts, and when it falls behind (8 streams of
        256-token prompts on two cores) the decode engine, idle between short steps, would
        otherwise wait for it. Never with ``max_prefill_queue`` 0, nor with
        ``disagg_min_tokens`` 0, which promises P/D always."""
        if self.max_prefill_queue <= 0 or self.disagg_min_tokens <= 0:  # 0: always P/D
            return False
        by_tokens = self.max_prefill_queue_tokens > 0 and all(
            e.in_flight_tokens >= self.max_prefill_queue_tokens for e in prefills
        )
        by_prompts = all(e.in_flight >= self.max_prefill_queue for e in prefills)
        return (by_prompts or by_tokens) and any(self._takes_local_prefill(e, uncached) for e in decodes)

    def _takes_local_prefill(self, engine: EngineHandle, uncached: int) -> bool:
        """Whether a decode engine takes one more prompt whole under the backlog rule: always when
        it is prefilling none itself, else while the prompts it is prefilling and this one come to
        at most ``max_local_prefill_queue_tokens`` uncached tokens. Its streams wait for those
        prefills' step, so a few short prompts at once (the long scenario's 64-token streams,
        which would otherwise queue at the prefill engine behind seconds of long prompts) but
        never two 256-token ones."""
        return engine.local_prefill_tokens == 0 or (
            engine.local_prefill_tokens + uncached <= self.max_local_prefill_queue_tokens
        )

    def _expected_hit_blocks(self, engine: EngineHandle, tokens: list[int], block_hashes: list) -> int:
        """The prompt's blocks ``engine``'s prefix cache is expected to hold. The last token is
        never a cache hit (its logits must be computed)."""
        block_size = self._limits()[2]
        return min(self.policy.expected_blocks(engine, block_hashes), (len(tokens) - 1) // block_size)

    def _uncached(self, engine: EngineHandle, tokens: list[int], block_hashes: list) -> int:
        """The prompt tokens ``engine`` is expected to compute."""
        return len(tokens) - self._expected_hit_blocks(engine, tokens, block_hashes) * self._limits()[2]

    async def _decode(
        self,
        live: LiveRequest,
        prompt: list[int],
        output: list[int],
        sampling: SamplingParams,
        engine_sampling: common_pb2.SamplingParams,
        priority: int,
        kv: common_pb2.KVTransferParams | None,
        block_hashes: list,
        timeout: float,
        text: TextStream,
        timings: dict,
        prefill_done: float | None = None,
        sink: TokenSink | None = None,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The decode stage, after ``output`` (the tokens already streamed: the prefill's first
        one, or none); ``sampling`` counts from the start of the output, and ``engine_sampling``
        is its message (``sampling_to_proto``).

        If the decode engine dies after streaming part of the answer, the rest is resumed on
        another healthy decode engine: it computes the prompt and every
        token streamed so far itself (the prefill engine released its blocks once they were
        pulled), and its sampler counts those tokens as its own output (``min_tokens``, penalties,
        ``max_tokens``), so the client's stream goes on where it stopped. Greedy requests get the
        tokens they would have got. With no other decode engine the request fails UNAVAILABLE,
        which clients retry.
        """
        resumes = 0
        while True:
            done = len(output)
            max_tokens = sampling.max_tokens - done
            if max_tokens < 1:
                # Never expected (a stage's last token ends it): refused as the params refuse it.
                dataclasses.replace(sampling, max_tokens=max_tokens, num_prior_output_tokens=done)
            stage = self._stream_stage(
                live,
                "decode",
                prompt + output,
                _stage_sampling(engine_sampling, max_tokens, max(0, sampling.min_tokens - done)),
                done,
                priority,
                kv,
                block_hashes,
                max(1.0, timeout - (time.perf_counter() - live.arrival)),
            )
            relay = self._relay(
                live,
                stage,
                text,
                timings,
                first_stage=not output,
                prefill_done=prefill_done,
                sink=sink,
                streamed=output,
            )
            try:
                try:
                    async for response, _ in relay:
                        yield response
                finally:
                    await relay.aclose()
                return
            except RouterError as exc:
                if not exc.resumable or resumes >= MAX_DECODE_RESUMES or live.aborted:
                    raise
                resumes += 1
                kv = None  # nothing left to pull: the next engine computes it all
                self.metrics.resumed.inc()
                logger.warning(
                    "%s: %s; resuming after %d output tokens on another decode engine",
                    live.request_id,
                    exc,
                    len(output),
                )

    async def _stream_stage(
        self,
        live: LiveRequest,
        role: str,
        tokens: list[int],
        sampling: common_pb2.SamplingParams,
        num_prior_output_tokens: int,
        priority: int,
        kv: common_pb2.KVTransferParams | None,
        block_hashes: list,
        timeout: float,
    ) -> AsyncGenerator[tuple[EngineHandle, engine_pb2.EngineGenerateResponse, SessionStream], None]:
        """Run one stage on an engine of ``role`` (``sampling``: the stage's, ``_stage_sampling``);
        retried once elsewhere if the engine was unreachable before it produced anything. Yields
        each message with the engine and the request's stream there."""
        tried: set[str] = set()
        # A decode stage with no KV to pull: the engine prefills the prompt itself.
        local_prefill = role == "decode" and kv is None
        while True:
            candidates = [e for e in self.pool.of_role(role) if e.address not in tried]
            if not candidates:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} engine")
            if local_prefill:
                # An engine busy prefilling other prompts is the second choice, and one whose
                # prefills this prompt would take past the budget the last.
                idle = [e for e in candidates if e.local_prefill_tokens == 0]
                fitting = idle or [
                    e
                    for e in candidates
                    if self._takes_local_prefill(e, self._uncached(e, tokens, block_hashes))
                ]
                engine = self.policy.pick(fitting or candidates, block_hashes)
            else:
                engine = self.policy.pick(candidates, block_hashes)
            block_size = self._limits()[2]
            live.expected_hit_blocks[role] = self._expected_hit_blocks(engine, tokens, block_hashes)
            self.policy.routed(engine, block_hashes)  # after the expectation: not its own blocks
            tried.add(engine.address)
            live.engines.append(engine)
            uncached_tokens = len(tokens) - live.expected_hit_blocks[role] * block_size
            engine.in_flight += 1
            engine.in_flight_tokens += uncached_tokens
            self.metrics.in_flight_by(role=role, engine=engine.address).set(engine.in_flight)
            produced = False
            call: SessionStream | None = None
            prefilling = local_prefill  # until its first message
            if prefilling:
                engine.local_prefill_tokens += uncached_tokens
            try:
                # On the engine's Session stream (one message a step for all of this router's
                # requests there), iterated as a Generate call would be, with its status codes.
                call = engine.session.open(
                    engine_pb2.EngineGenerateRequest(
                        request_id=live.request_id,
                        prompt_token_ids=tokens,
                        sampling=sampling,
                        priority=priority,
                        kv_transfer_params=kv,
                        num_prior_output_tokens=num_prior_output_tokens,
                    ),
                    timeout,
                )
                live.calls.append(call)
                async for message in call:
                    if prefilling:
                        prefilling = False
                        engine.local_prefill_tokens -= uncached_tokens
                    produced = True
                    if message.finish_reason:
                        # Its prefix cache now holds the prompt (remembered before the caller,
                        # done with the request, may close this stage at the last message).
                        engine.remember_blocks(block_hashes)
                    yield engine, message, call
                    if message.finish_reason:
                        # The last message: don't wait for the stream's closing status (a
                        # round trip) before the next stage, the decode handover, can start.
                        return
                return
            except asyncio.CancelledError:
                if live.aborted:
                    raise _Aborted() from None
                raise
            except grpc.aio.AioRpcError as exc:
                if live.aborted:
                    raise _Aborted() from None
                code = exc.code()
                if code == grpc.StatusCode.CANCELLED and not produced:
                    # Not our cancel (that sets live.aborted or raises CancelledError): the
                    # engine's server cancelled the call, as gRPC does to a call that arrives
                    # while the server stops (an engine done draining, before this router
                    # noticed). Nothing ran, so it is retriable like an unreachable engine.
                    code = grpc.StatusCode.UNAVAILABLE
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    # Refused: the id is another request's there, which our clean-up must not abort.
                    live.engines.remove(engine)
                if code == grpc.StatusCode.UNAVAILABLE:
                    engine.mark_down(exc.details() or "unreachable")
                    if not produced and len(tried) < 2:
                        logger.warning(
                            "%s: %s engine %s unreachable, retrying elsewhere",
                            live.request_id,
                            role,
                            engine.address,
                        )
                        continue
                # The engine went away: another can go on. Not a lost KV transfer (ABORTED): an
                # engine refuses it under --kv-load-failure-policy fail so that no decode engine
                # computes the prompt, which a resume would do.
                resumable = code == grpc.StatusCode.UNAVAILABLE
                if code == grpc.StatusCode.ABORTED:
                    # The engine is fine but this request's remote KV was lost: retriable by the client.
                    code = grpc.StatusCode.UNAVAILABLE
                raise RouterError(
                    code, f"{role} engine {engine.address}: {exc.details()}", resumable=resumable
                ) from None
            finally:
                if call is not None:
                    call.close()  # left early (the caller closed this stage): the engine aborts it
                if prefilling:
                    engine.local_prefill_tokens -= uncached_tokens
                engine.in_flight -= 1
                engine.in_flight_tokens -= uncached_tokens
                self.metrics.in_flight_by(role=role, engine=engine.address).set(engine.in_flight)

    async def _relay(
        self,
        live: LiveRequest,
        stage: AsyncGenerator[tuple[EngineHandle, engine_pb2.EngineGenerateResponse, SessionStream], None],
        text: TextStream,
        timings: dict[str, float],
        first_stage: bool,
        last_stage: bool = True,
        prefill_done: float | None = None,
        sink: TokenSink | None = None,
        streamed: list[int] | None = None,
    ) -> AsyncGenerator[tuple[router_pb2.GenerateResponse, engine_pb2.EngineGenerateResponse], None]:
        """Turn engine messages into router messages (text deltas, metrics on the last one).

        A non-last stage (prefill before decode) ends the request only if it finished for
        another reason than handing over (``length`` after its one token): EOS, stop, abort.
        A stop string ends it wherever it matches; the caller then aborts it on the engines.

        Every token relayed is added to ``streamed`` (when given: what a resume starts from).
        With a ``sink`` (a last stage, no stop strings), once the stage's first token went out
        its plain tokens go to the sink from the session's reader (``relay_token``).
        """
        stage_start = time.perf_counter()
        last_token_at: float | None = None
        hits_recorded = False
        itl = self.metrics.itl
        use_sink = sink is not None and streamed is not None and last_stage and not text.stop
        # Inter-token gaps of tokens sent to the sink, observed ITL_BATCH at a time (and at the
        # stage's end): one histogram update a token is a few us on a busy core, less in a row.
        gaps: list[float] = []
        # Only used when use_sink (so neither is None then).
        to_sink, resume_from = cast(TokenSink, sink), cast(list[int], streamed)

        def observe_gaps() -> None:
            observe_many(itl, gaps)
            gaps.clear()

        def relay_token(message: engine_pb2.EngineGenerateResponse) -> bool:
            # The loop below for a message that only carries tokens; anything else (a last
            # message, timeline, a cache count) declines, to be relayed there.
            nonlocal last_token_at
            if (
                message.finish_reason
                or not message.token_ids
                or message.timeline
                or message.num_cached_tokens > timings.get("num_cached_tokens", 0)
                or not to_sink.ready()
            ):
                return False
            now = time.perf_counter()
            tokens = list(message.token_ids)
            gaps.append(now - (last_token_at or now))
            if len(gaps) >= ITL_BATCH:
                observe_gaps()
            last_token_at = now
            delta = text.push(tokens)
            resume_from.extend(tokens)
            to_sink.tokens(delta, tokens)
            return True

        def on_relayed(relayed: Relayed) -> None:
            # What the C relay sent, as if relay_token had: the same text, resume point, usage
            # and gaps (its rest of a chunk first, before anything else goes to the client).
            nonlocal last_token_at
            to_sink.relayed(relayed)
            text.relayed(relayed.token_ids, relayed.text)
            resume_from.extend(relayed.token_ids)
            gaps.extend(relayed.gaps)
            if len(gaps) >= ITL_BATCH:
                observe_gaps()
            last_token_at = relayed.last_at

        def relay_ready() -> tuple[float, int] | None:
            # In step: a token went out (the gaps run from it), no text held back, the client's
            # transport empty and writable.
            if last_token_at is None or not text.in_step() or not to_sink.ready_for_relay():
                return None
            return last_token_at, int(timings.get("num_cached_tokens", 0))

        try:
            try:
                async for engine, message, call in stage:
                    now = time.perf_counter()
                    tokens = list(message.token_ids)
                    if timeline := message.timeline:
                        for event in timeline:  # not .items(): a Python generator step an event
                            live.timeline.setdefault(f"{engine.role}.{event}", timeline[event])
                    if tokens:
                        if last_token_at is not None:
                            itl.observe(now - last_token_at)
                        else:
                            if first_stage and "ttft_ms" not in timings:
                                live.timeline["router.first_token"] = time.time()
                                timings["ttft_ms"] = (now - live.arrival) * 1e3
                                timings["prefill_ms"] = (now - stage_start) * 1e3
                                self.metrics.ttft.observe(now - live.arrival)
                            if prefill_done is not None and "transfer_ms" not in timings:
                                live.timeline["router.decode_first_token"] = time.time()
                                timings["transfer_ms"] = (now - prefill_done) * 1e3
                                self.metrics.transfer.observe(now - prefill_done)
                        last_token_at = now
                    if not hits_recorded:
                        timings[f"{engine.role}_engine"] = engine.address  # type: ignore[assignment]
                        if (tokens or message.finish_reason) and f"{engine.role}_hit_blocks" not in timings:
                            hits_recorded = True
                            self._record_hits(
                                live, engine.role, message, timings, pulled=prefill_done is not None
                            )
                    if message.num_cached_tokens > timings.get("num_cached_tokens", 0):
                        timings["num_cached_tokens"] = message.num_cached_tokens
                    finish_reason = message.finish_reason
                    final = bool(finish_reason) and (last_stage or finish_reason != "length")
                    delta = text.push(tokens, final=final)
                    if text.matched_stop is not None:
                        live.cut_short = not final
                        final, finish_reason = True, "stop"
                        timings["stop_reason"] = text.matched_stop  # type: ignore[assignment]
                    out = router_pb2.GenerateResponse(
                        request_id=live.request_id,
                        token_ids=tokens,
                        text=delta,
                        finish_reason=finish_reason if final else "",
                    )
                    if final:
                        if prefill_done is not None:
                            timings["decode_ms"] = (now - prefill_done) * 1e3
                        live.timeline["router.done"] = time.time()
                        out.metrics.CopyFrom(_metrics(timings, live.timeline))
                        self.trace.write(live.request_id, out.metrics)
                        self.metrics.requests_by(finish_reason=finish_reason).inc()
                    if streamed is not None:
                        streamed.extend(tokens)
                    yield out, message
                    if final:
                        return
                    # Once this stage's first token went out (a resumed stage's too).
                    if use_sink and last_token_at is not None and call.fast is None:
                        call.fast = relay_token
                        if self.token_relay is not None and (target := to_sink.relay_target()) is not None:
                            call.use_relay(self.token_relay, target, on_relayed, relay_ready)
            finally:
                observe_gaps()
        finally:
            await stage.aclose()

    def _record_hits(
        self,
        live: LiveRequest,
        role: str,
        message: engine_pb2.EngineGenerateResponse,
        timings: dict,
        pulled: bool,
    ) -> None:
        """The prefix-cache hit the engine reported against the router's expectation (a
        histogram of the difference), and the blocks a decode engine pulled from prefill."""
        block_size = self._limits()[2]
        hit = message.num_prefix_hit_tokens // block_size
        expected = live.expected_hit_blocks.get(role, 0)
        timings[f"{role}_hit_blocks"] = hit
        timings[f"expected_{role}_hit_blocks"] = expected
        self.metrics.kv_hit_error_by(role=role).observe(hit - expected)
        if pulled:
            external = max(0, message.num_cached_tokens - message.num_prefix_hit_tokens)
            timings["decode_pulled_blocks"] = -(-external // block_size)

    async def _abort_on_engines(self, live: LiveRequest) -> None:
        for engine in {e.address: e for e in live.engines}.values():
            # UsageError: the engine left the pool (its channel is closed) since the request used it.
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError):
                await engine.stub.Abort(common_pb2.AbortRequest(request_id=live.request_id), timeout=2.0)
        if live.engines:
            logger.info("%s: aborted on %s", live.request_id, [e.address for e in live.engines])

    # ------------------------------------------------------------------ Abort, Stats

    async def abort_request(self, request_id: str) -> bool:
        """End a request everywhere (Abort RPC, HTTP client gone); False if it is not running
        (or already ending: its id stays taken until its aborts have gone out)."""
        live = self.live.get(request_id)
        if live is None or live.aborted:
            return False
        live.abort()
        await self._abort_on_engines(live)
        return True

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return common_pb2.AbortResponse(found=await self.abort_request(request.request_id))

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        async def one(engine: EngineHandle) -> common_pb2.EngineStats:
            if engine.healthy:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    stats = await engine.stub.Stats(common_pb2.StatsRequest(), timeout=2.0)
                    stats.role, stats.address = engine.role, engine.address
                    return stats
            return common_pb2.EngineStats(role=engine.role, address=engine.address, healthy=False)

        stats = await asyncio.gather(*(one(e) for e in self.pool.engines))
        for engine in self.pool.engines:
            self.metrics.healthy.labels(role=engine.role, engine=engine.address).set(int(engine.healthy))
        return router_pb2.RouterStats(engines=stats)


def _stage_sampling(
    engine_sampling: common_pb2.SamplingParams, max_tokens: int, min_tokens: int
) -> common_pb2.SamplingParams:
    """A stage's sampling message: the request's (``sampling_to_proto`` of its validated params)
    with the stage's token counts, the message ``sampling_to_proto`` gives for the params
    ``dataclasses.replace`` makes with those counts (which would validate them all again)."""
    msg = common_pb2.SamplingParams()
    msg.CopyFrom(engine_sampling)
    msg.max_tokens = max_tokens
    msg.min_tokens = min_tokens
    return msg


def _metrics(timings: dict, timeline: dict[str, float]) -> router_pb2.RequestMetrics:
    received = timeline["router.receive"]
    return router_pb2.RequestMetrics(
        timeline_ms={event: (at - received) * 1e3 for event, at in timeline.items()},
        ttft_ms=timings.get("ttft_ms", 0.0),
        prefill_ms=timings.get("prefill_ms", 0.0),
        transfer_ms=timings.get("transfer_ms", 0.0),
        decode_ms=timings.get("decode_ms", 0.0),
        queue_ms=timings.get("queue_ms", 0.0),
        prefill_engine=str(timings.get("prefill_engine", "")),
        decode_engine=str(timings.get("decode_engine", "")),
        num_cached_tokens=int(timings.get("num_cached_tokens", 0)),
        num_prompt_tokens=int(timings.get("num_prompt_tokens", 0)),
        stop_reason=str(timings.get("stop_reason", "")),
        expected_prefill_hit_blocks=int(timings.get("expected_prefill_hit_blocks", 0)),
        prefill_hit_blocks=int(timings.get("prefill_hit_blocks", 0)),
        expected_decode_hit_blocks=int(timings.get("expected_decode_hit_blocks", 0)),
        decode_hit_blocks=int(timings.get("decode_hit_blocks", 0)),
        decode_pulled_blocks=int(timings.get("decode_pulled_blocks", 0)),
    )
