"""The router's OpenAI-compatible HTTP front door: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and ``/metrics``.

One process, two front doors: this app runs on the router's event loop beside its gRPC server
and translates each HTTP request into the router's own ``GenerateRequest``, then drives the one
request path (``RouterServicer.prepare`` -> ``admit`` -> ``run``), so routing, conditional
disaggregation, stop strings, aborts and metrics are the gRPC path's. A body of ``n`` choices
(or a batch of prompts) becomes that many router requests, run concurrently.

A client that goes away aborts its requests on every engine through ``abort_request``, the
Abort RPC's path: a task waits for the ASGI ``http.disconnect`` message while the answer is
computed or streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import orjson
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve.engine.model.tokenizer import NoChatTemplateError
from pdserve.router.auth import OPEN_HTTP_PATHS, ApiKeys, HttpKeyMiddleware
from pdserve.router.http_server import EmbeddedServer
from pdserve.router.openai_protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _SamplingRequest,
)
from pdserve.router.service import LiveRequest, PreparedRequest, RouterError, RouterServicer
from pdserve.router.token_relay import Relayed
from pdserve.tls import ServerTls
from pdserve.v1 import router_pb2

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
# OpenAI's default max_tokens for /v1/completions; chat defaults to what the context leaves.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A chat request to a model whose files carry no chat template (Gemma 3 270M's GGUF, say).
NO_CHAT_TEMPLATE_HTTP = (
    "This model has no chat template, so /v1/chat/completions cannot make messages into a prompt; "
    "send the text as a plain prompt to /v1/completions instead."
)
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")

_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}

Body = TypeVar("Body", bound=_SamplingRequest)


def openai_error_of(exc: RouterError) -> OpenAIError:
    status, type_, code = _STATUS_OF_CODE.get(exc.code, (500, "server_error", None))
    return OpenAIError(status, str(exc), type_, code=code)


@dataclass
class Choice:
    """One router request behind one ``choices[index]`` of an answer."""

    index: int
    live: LiveRequest
    prepared: PreparedRequest
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, response: router_pb2.GenerateResponse) -> None:
        self.add_tokens(response.text, response.token_ids)
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.stop_reason = response.metrics.stop_reason or None

    def add_tokens(self, text: str, token_ids: Iterable[int]) -> None:
        self.text.append(text)
        self.token_ids.extend(token_ids)

    def item(
        self, chat: bool, text: str, token_ids: list[int] | None, last: bool, delta: bool
    ) -> dict[str, Any]:
        """``choices[i]`` of an answer (``delta=False``) or of a stream chunk."""
        item: dict[str, Any] = {"index": self.index}
        if chat and delta:
            item["delta"] = {"content": text} if text or not last else {}
        elif chat:
            item["message"] = {"role": "assistant", "content": text}
        else:
            item["text"] = text
        item["logprobs"] = None
        item["finish_reason"] = self.finish_reason if last else None
        item["stop_reason"] = self.stop_reason if last else None
        if token_ids is not None:
            item["token_ids"] = token_ids
        return item


class OpenAIServer:
    """The app and its uvicorn server. With ``keys``, every path but the open ones (``/health``
    and ``/metrics``, unless ``protect_metrics``) needs ``Authorization: Bearer KEY``; with
    ``tls``, uvicorn serves HTTPS only."""

    def __init__(
        self,
        servicer: RouterServicer,
        served_model_name: str,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        keys: ApiKeys | None = None,
        protect_metrics: bool = False,
        tls: ServerTls | None = None,
    ) -> None:
        self.servicer = servicer
        self.tls = tls
        self.metrics = servicer.metrics
        self.model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.retrieve_model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_exception_handler(OpenAIError, _openai_error_response)
        app.add_exception_handler(StarletteHTTPException, _http_error_response)
        # The two generation routes straight to their handlers; the rest through FastAPI.
        gated: Callable = _GenerationRoutes(
            app, {"/v1/completions": self.completions, "/v1/chat/completions": self.chat_completions}
        )
        if keys:
            gated = HttpKeyMiddleware(gated, keys, () if protect_metrics else OPEN_HTTP_PATHS)
        # Outermost, so refusals (401) are counted too.
        self.app = _CountRequests(gated, self.metrics)
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ serving

    async def start(self, host: str, port: int) -> None:
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=5,
            **(self.tls.uvicorn_options() if self.tls else {}),
        )
        self._server = EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(), name="http-front")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start (port in use, ...)
                raise RuntimeError(f"HTTP server on {host}:{port} stopped during start-up")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ small endpoints

    async def health(self) -> Response:
        if self.servicer.healthy():
            return JSONResponse({"status": "ok"})
        raise OpenAIError(
            503, "no healthy decode engine", "service_unavailable_error", code="service_unavailable"
        )

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict[str, Any]:
        try:
            max_model_len: int | None = self.servicer.max_model_len()
        except RouterError:
            max_model_len = None  # no engine has come up yet
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "root": self.model_name,
            "parent": None,
            "max_model_len": max_model_len,
        }

    async def list_models(self) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, model: str) -> Response:
        self._check_model(model)
        return JSONResponse(self._model_card())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        choices = self._start(request, body, body.prompts(), COMPLETIONS_DEFAULT_MAX_TOKENS, "cmpl")
        return await self._answer(request, body, choices, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        choices = self._start(request, body, [body.generate_request()], None, "chatcmpl")
        return await self._answer(request, body, choices, chat=True)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise OpenAIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise OpenAIError(
                413, f"request body of {declared} bytes is over the {self.max_body_bytes}-byte limit"
            )
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise OpenAIError(413, f"request body is over the {self.max_body_bytes}-byte limit")
        try:
            body = model.model_validate_json(bytes(raw))
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from None
        self._check_model(body.model)
        body.check_unsupported()
        return body

    def _start(
        self,
        request: Request,
        body: _SamplingRequest,
        prompts: list[router_pb2.GenerateRequest],
        default_max_tokens: int | None,
        id_prefix: str,
    ) -> list[Choice]:
        """Validate every prompt, then admit one router request per (prompt, choice); all or none."""
        n = body.num_choices()
        if n * len(prompts) > MAX_CHOICES:
            raise OpenAIError(
                400, f"n x prompts = {n * len(prompts)} is over the limit of {MAX_CHOICES}", param="n"
            )
        stop = body.stop_strings()
        prepared_prompts = [self._prepare(body, prompt, stop, default_max_tokens) for prompt in prompts]
        base_id = request.headers.get("x-request-id") or f"{id_prefix}-{uuid.uuid4().hex}"
        choices: list[Choice] = []
        try:
            for prepared in prepared_prompts:
                for i in range(n):
                    index = len(choices)
                    request_id = base_id if n * len(prompts) == 1 else f"{base_id}-{index}"
                    live = self.servicer.admit(request_id)
                    choices.append(Choice(index, live, _choice_request(prepared, n, i)))
        except RouterError as exc:
            for choice in choices:
                self.servicer.live.pop(choice.live.request_id, None)
            raise openai_error_of(exc) from None
        return choices

    def _prepare(
        self,
        body: _SamplingRequest,
        prompt: router_pb2.GenerateRequest,
        stop: list[str],
        default_max_tokens: int | None,
    ) -> PreparedRequest:
        requested = body.max_tokens
        # Validated with a placeholder when unset: the default depends on the prompt's length.
        prompt.sampling.CopyFrom(
            body.sampling_proto(requested if requested is not None else max(1, body.min_tokens or 0))
        )
        prompt.stop.extend(stop)
        prompt.include_stop_str_in_output = bool(body.include_stop_str_in_output)
        prompt.priority = body.priority or 0
        try:
            tokens = self.servicer.tokenize(prompt)
            max_model_len = self.servicer.max_model_len()
            max_tokens = requested
            if max_tokens is None:
                room = max_model_len - len(tokens)
                max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
                if prompt.sampling.min_tokens <= max_tokens:
                    # The default in the placeholder's place: the params are made and checked
                    # once, with the same outcome (neither value fails a check the other passes).
                    prompt.sampling.max_tokens = max_tokens
            prepared = self.servicer.prepare(prompt, tokens)
        except NoChatTemplateError:
            raise OpenAIError(400, NO_CHAT_TEMPLATE_HTTP, param="messages") from None
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=_param_of(str(exc))) from None
        except RouterError as exc:
            raise openai_error_of(exc) from None
        num_prompt = len(tokens)
        if requested is not None and num_prompt + requested > max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} in the completion). "
                "Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        if prepared.sampling.max_tokens == max_tokens:
            return prepared
        # The placeholder stayed (min_tokens is over the default): refused here, naming both.
        try:
            sampling = dataclasses.replace(prepared.sampling, max_tokens=max_tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=_param_of(str(exc))) from None
        return dataclasses.replace(prepared, sampling=sampling)

    async def _answer(
        self, request: Request, body: _SamplingRequest, choices: list[Choice], chat: bool
    ) -> Response:
        response_id = (
            choices[0].live.request_id.rsplit("-", 1)[0] if len(choices) > 1 else choices[0].live.request_id
        )
        if body.stream:
            stream = self._stream(request, body, choices, chat, response_id)
            return _EventStream(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            await self._until_disconnect(request, choices, self._collect(choices))
        finally:
            for choice in choices:  # admitted but never run (an error elsewhere): release them
                self.servicer.live.pop(choice.live.request_id, None)
        with_ids = bool(body.return_token_ids)
        items = [
            c.item(chat, "".join(c.text), c.token_ids if with_ids else None, True, False) for c in choices
        ]
        answer: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": items,
            "usage": _usage(choices),
        }
        if with_ids:
            answer["prompt_token_ids"] = [c.prepared.prompt_token_ids for c in choices]
        return JSONResponse(answer)

    async def _collect(self, choices: list[Choice]) -> None:
        """Run every choice to the end; the first failure cancels the rest and is raised."""

        async def one(choice: Choice) -> None:
            async with contextlib.aclosing(self.servicer.run(choice.live, choice.prepared)) as responses:
                async for response in responses:
                    choice.add(response)

        tasks = [asyncio.create_task(one(c)) for c in choices]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise openai_error_of(exc) if isinstance(exc, RouterError) else exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _until_disconnect(self, request: Request, choices: list[Choice], work: Awaitable[None]) -> None:
        """Await ``work``; if the client disconnects first, abort every choice on every engine."""
        watcher = asyncio.create_task(self._watch_disconnect(request, choices))
        try:
            await work
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, request: Request, choices: list[Choice]) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        logger.info("%s: client disconnected, aborting", [c.live.request_id for c in choices])
        await asyncio.gather(*(self.servicer.abort_request(c.live.request_id) for c in choices))

    async def _stream(
        self, request: Request, body: _SamplingRequest, choices: list[Choice], chat: bool, response_id: str
    ) -> AsyncIterator[bytes]:
        """Server-sent events as OpenAI sends them: chunks, an optional usage chunk, [DONE]."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.include_usage()
        # vLLM's extension: every chunk carries the usage so far (benchmarks count tokens by it).
        continuous_usage = include_usage and bool(
            body.stream_options and body.stream_options.continuous_usage_stats
        )

        def event(choice_items: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            chunk: dict[str, Any] = {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": choice_items,
            }
            if include_usage:
                chunk["usage"] = usage
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        def error_event(exc: RouterError) -> bytes:
            return f"data: {json.dumps(openai_error_of(exc).body())}\n\n".encode()

        def token_event(choice: Choice, item: router_pb2.GenerateResponse) -> bytes | None:
            choice.add(item)
            return chunk_of(choice, item.text, item.token_ids, bool(item.finish_reason))

        def chunk_of(choice: Choice, text: str, token_ids: Iterable[int], last: bool) -> bytes | None:
            ids = list(token_ids) if body.return_token_ids else None
            if not (text or last or continuous_usage or ids):
                return None  # nothing to tell yet (a partial UTF-8 character is held back)
            usage = _usage([choice]) if continuous_usage else None
            return event([choice.item(chat, text, ids, last, True)], usage)

        # A plain token's chunk is the same but for its text: made once, filled in per token.
        templated = not (continuous_usage or body.return_token_ids)
        template = event([choices[0].item(chat, _TEXT_MARK, None, False, True)])
        assert template.count(orjson.dumps(_TEXT_MARK)) == 1
        head, _, tail = template.partition(orjson.dumps(_TEXT_MARK))

        def plain_token(choice: Choice, text: str, token_ids: list[int]) -> bytes | None:
            choice.text.append(text)  # ``add_tokens``, inline on every token's way
            choice.token_ids.extend(token_ids)
            if templated:
                return head + orjson.dumps(text) + tail if text else None
            return chunk_of(choice, text, token_ids, False)

        watcher = asyncio.create_task(self._watch_disconnect(request, choices))
        sink: _ChunkSink | None = None
        try:
            if chat:
                for c in choices:
                    yield event(
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            if len(choices) == 1:
                # Iterated in place: a generator layer, a task and a queue hop per token less.
                choice = choices[0]
                sink = _ChunkSink.of(
                    request.scope.get(_SERVER_SEND),
                    functools.partial(plain_token, choice),
                    choice,
                    (head, tail) if templated else None,
                )
                try:
                    async with contextlib.aclosing(
                        self.servicer.run(choice.live, choice.prepared, sink=sink)
                    ) as responses:
                        async for response in responses:
                            if (data := token_event(choice, response)) is not None:
                                yield data
                except RouterError as exc:
                    yield error_event(exc)
            else:
                async with contextlib.aclosing(self._responses(choices)) as merged:
                    async for choice, item in merged:
                        data = (
                            error_event(item) if isinstance(item, RouterError) else token_event(choice, item)
                        )
                        if data is not None:
                            yield data
            if include_usage:
                yield event([], _usage(choices))
            yield b"data: [DONE]\n\n"
        finally:
            watcher.cancel()
            by_reader = sink.tokens_sent if sink is not None else 0
            self.metrics.streamed_tokens_by(path="reader").inc(by_reader)
            if sink is not None and sink.tokens_relayed:
                self.metrics.relayed_tokens.inc(sink.tokens_relayed)
            self.metrics.streamed_tokens_by(path="task").inc(
                sum(len(c.token_ids) for c in choices) - by_reader
            )
            for choice in choices:
                self.servicer.live.pop(choice.live.request_id, None)

    async def _responses(
        self, choices: list[Choice]
    ) -> AsyncGenerator[tuple[Choice, router_pb2.GenerateResponse | RouterError], None]:
        """Every choice's responses as they come (a failure as its RouterError, then no more of
        that choice), for an answer of several choices."""
        queue: asyncio.Queue[tuple[Choice, router_pb2.GenerateResponse | RouterError | None]] = (
            asyncio.Queue()
        )

        async def pump(choice: Choice) -> None:
            try:
                async with contextlib.aclosing(self.servicer.run(choice.live, choice.prepared)) as responses:
                    async for response in responses:
                        await queue.put((choice, response))
            except RouterError as exc:
                await queue.put((choice, exc))
            finally:
                await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            running = len(choices)
            while running:
                choice, item = await queue.get()
                if item is None:
                    running -= 1
                else:
                    yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _choice_request(prepared: PreparedRequest, n: int, i: int) -> PreparedRequest:
    """Choice ``i`` of ``n``'s request: ``prepared`` itself (nothing in it changes once
    prepared), or with a seed of its own."""
    seed = prepared.sampling.seed
    if n == 1 or seed is None:
        return prepared
    # Each choice draws its own tokens (vLLM: seed + index); still reproducible.
    return dataclasses.replace(prepared, sampling=dataclasses.replace(prepared.sampling, seed=seed + i))


def _usage(choices: list[Choice]) -> dict[str, int]:
    # A prompt with n choices is counted once, as OpenAI does.
    prompts = {id(c.prepared.prompt_token_ids): len(c.prepared.prompt_token_ids) for c in choices}
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _param_of(message: str) -> str | None:
    """The field a validation message names (they start with the field's name)."""
    head = message.split()[0].rstrip(":,") if message.split() else ""
    if head == "prompt_token_ids":
        return "prompt"
    return head if head.isidentifier() else None


def _validation_error(exc: pydantic.ValidationError) -> OpenAIError:
    error = exc.errors()[0]
    param = ".".join(str(part) for part in error["loc"]) or None
    if error["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if error["type"] == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {error['msg']}")
    if error["type"] == "model_type" and not error["loc"]:
        return OpenAIError(400, "the body must be a JSON object")
    where = f"{param}: " if param else ""
    return OpenAIError(400, f"{where}{error['msg']}", param=param)


async def _openai_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


class _GenerationRoutes:
    """ASGI: ``POST /v1/completions`` and ``POST /v1/chat/completions`` straight to their
    handlers, every other request to FastAPI (``app``). Those handlers take the raw request and
    answer a failure with ``OpenAIError``, so FastAPI's routing, its dependency solving and its
    exception and error middlewares (about 140 Python calls a request, 5% of the router's CPU
    at 8 streams on two busy cores) did nothing for them. Any other exception reaches uvicorn,
    which answers 500, as FastAPI's error middleware did."""

    def __init__(self, app: Callable, routes: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (
            self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except OpenAIError as exc:
            response = await _openai_error_response(request, exc)
        await response(scope, receive, send)


# Stands for a token's text in a chunk made once per stream (``OpenAIServer._stream``).
_TEXT_MARK = "\x00text\x00"

# Where ``_CountRequests`` leaves the server's ``send`` in a request's scope.
_SERVER_SEND = "pdserve.server_send"


class _CountRequests:
    """ASGI middleware: counts HTTP requests by endpoint and status (streams included)."""

    def __init__(self, app: Callable, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = (
            path
            if path in ENDPOINTS
            else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        )
        status = {"code": 500}

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        # The server's own send, for a stream's chunks once its status went out through the
        # middlewares (``_EventStream``): they only watch the start of a response.
        scope[_SERVER_SEND] = send

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.http_requests_by(endpoint=endpoint, status=str(status["code"])).inc()


class _EventStream(StreamingResponse):
    """Server-sent events, streamed in the request's own task. Under uvicorn's ASGI 2.3,
    starlette's StreamingResponse gives each response a task group and a second task that
    listens for the client's disconnect, which ``OpenAIServer._stream`` watches itself (and
    aborts the request on); ending that group formatted a task's repr for its cancel message,
    about 5% of the router's CPU per request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # Each token's chunk straight to the server: three middleware layers (which only
        # watch a response's start) less per token.
        send_chunk = scope.get(_SERVER_SEND, send)
        async for chunk in self.body_iterator:
            await send_chunk({"type": "http.response.body", "body": chunk, "more_body": True})
        await send_chunk({"type": "http.response.body", "body": b"", "more_body": False})


class _ChunkSink:
    """A stream's plain tokens, written to the client from the engine session's reader
    (``pdserve.router.service.TokenSink``), each as one HTTP chunk on uvicorn's transport.

    Once the stream's first chunk went out through the ASGI ``send``, the rest of its body is
    chunks that ``send`` would write as they are; writing them here saves the ASGI message and
    ``send``'s checks per token (about 10 us of CPU on two busy cores). The sink holds
    uvicorn's httptools request cycle (``send``'s owner) for that, and says not ready
    (the request's task then sends the token) while the connection is paused for flow
    control, closed, or not chunked. Another server (h11's cycle has no such fields) gets no
    sink."""

    _CYCLE_FIELDS = ("transport", "flow", "disconnected", "chunked_encoding", "response_complete")

    def __init__(
        self,
        cycle: Any,
        chunk: Callable[[str, list[int]], bytes | None],
        choice: Choice,
        template: tuple[bytes, bytes] | None,
    ) -> None:
        self._cycle = cycle
        self._chunk = chunk
        self._choice = choice
        # A plain token's chunk around its text (a JSON string), when every plain token's chunk
        # is that: the C token relay writes those chunks itself.
        self._template = template
        self.tokens_sent = 0  # by the session's reader: here, or by the token relay
        self.tokens_relayed = 0

    @classmethod
    def of(
        cls,
        send: Callable | None,
        chunk: Callable[[str, list[int]], bytes | None],
        choice: Choice,
        template: tuple[bytes, bytes] | None,
    ) -> _ChunkSink | None:
        cycle: Any = getattr(send, "__self__", None)
        for name in cls._CYCLE_FIELDS:
            if not hasattr(cycle, name):
                return None
        return cls(cycle, chunk, choice, template) if hasattr(cycle.flow, "write_paused") else None

    def relay_target(self) -> tuple[int, bytes, bytes] | None:
        """(the client's socket, the chunk's text before and after) for the C token relay; None
        where it cannot write the chunks (TLS, or chunks that carry more than the text)."""
        transport = self._cycle.transport
        if self._template is None or transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        return sock.fileno(), *self._template

    def ready_for_relay(self) -> bool:
        """Ready, and nothing in the transport's buffer that the relay's writes would overtake."""
        return self.ready() and self._cycle.transport.get_write_buffer_size() == 0

    def relayed(self, relayed: Relayed) -> None:
        """What the relay sent, as ``tokens`` would have: the answer's text and ids; the rest of
        a chunk the socket did not take goes to the transport, ahead of anything later."""
        if relayed.rest:
            self._cycle.transport.write(relayed.rest)
        self._choice.text.append(relayed.text)  # ``add_tokens``, as plain_token does
        self._choice.token_ids.extend(relayed.token_ids)
        self.tokens_sent += len(relayed.token_ids)
        self.tokens_relayed += len(relayed.token_ids)

    def ready(self) -> bool:
        cycle = self._cycle
        return (
            cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.flow.write_paused
            and not cycle.disconnected
        )

    def tokens(self, text: str, token_ids: list[int]) -> None:
        data = self._chunk(text, token_ids)
        if data is not None:
            self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.tokens_sent += len(token_ids)
