"""The client side of ``pdserve bench serve``: an open loop of streamed requests through the
router's gRPC API or its OpenAI HTTP API, and the router/engine queries the driver waits on.

Kept apart from the driver (``pdserve.bench.serve.driver``) so each module stays about one concern.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING, Any

from pdserve.bench.serve.report import RequestResult

if TYPE_CHECKING:
    from pdserve.bench.serve.workload import RequestSpec

REQUEST_TIMEOUT_S = 600.0  # a request still streaming after this counts as failed (DEADLINE_EXCEEDED)


async def run_requests(
    address: str, specs: list[RequestSpec], tag: str, progress=None
) -> list[RequestResult]:
    """Send each spec at its arrival time (open loop) and stream it to the end."""
    import grpc

    from pdserve.router.auth import client_metadata
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    metadata = client_metadata()  # a router that wants a key: $PDSERVE_API_KEY(S)
    results = [RequestResult(spec) for spec in specs]
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()

        async def one(result: RequestResult) -> None:
            spec = result.spec
            await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
            request = router_pb2.GenerateRequest(
                request_id=f"{tag}-{spec.index}-{secrets.token_hex(4)}",
                prompt_token_ids=spec.prompt_token_ids,
                sampling=common_pb2.SamplingParams(
                    max_tokens=spec.output_len, temperature=0.0, ignore_eos=True
                ),
            )
            result.sent = time.perf_counter()
            try:
                async for message in stub.Generate(request, timeout=REQUEST_TIMEOUT_S, metadata=metadata):
                    if message.token_ids:
                        result.token_times.append((time.perf_counter(), len(message.token_ids)))
                    if message.HasField("metrics"):
                        result.metrics = {
                            f.name: getattr(message.metrics, f.name)
                            for f in message.metrics.DESCRIPTOR.fields
                        }
            except grpc.aio.AioRpcError as exc:
                result.error = f"{exc.code().name}: {exc.details()}"
            if progress is not None:
                progress.update(1)

        await asyncio.gather(*(one(r) for r in results))
    return results


async def run_requests_openai(
    base_url: str, specs: list[RequestSpec], tag: str, progress=None
) -> list[RequestResult]:
    """The same open loop through the router's OpenAI API: ``/v1/completions`` streamed, with
    vLLM's ``continuous_usage_stats`` so each event says how many tokens it carries."""
    from pdserve.bench.serve.sse_client import HTTPStatusError, stream_events

    results = [RequestResult(spec) for spec in specs]
    start = time.perf_counter()

    async def one(result: RequestResult) -> None:
        spec = result.spec
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
        body = {
            "prompt": spec.prompt_token_ids,
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        result.sent = time.perf_counter()
        seen = 0
        try:
            async for arrived, event in stream_events(f"{base_url}/completions", body, REQUEST_TIMEOUT_S):
                if "error" in event:
                    result.error = f"stream error: {event['error'].get('message')}"
                    break
                usage = event.get("usage") or {}
                tokens = usage.get("completion_tokens", seen) - seen
                if tokens > 0 and event.get("choices"):
                    result.token_times.append((arrived, tokens))
                    seen += tokens
        except (HTTPStatusError, OSError, TimeoutError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        if progress is not None:
            progress.update(1)

    await asyncio.gather(*(one(r) for r in results))
    return results


def engine_info(address: str) -> Any:
    import grpc

    from pdserve.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=10.0)


def wait_router_ready(address: str, num_engines: int, timeout_s: float) -> None:
    """Until the router sees every engine healthy and idle (nothing running, waiting or held)."""
    from pdserve.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            stats = client.stats()
            ready = len(stats) == num_engines and all(
                s["healthy"]
                and s["num_running"] == s["num_waiting"] == s["num_waiting_for_remote_kvs"] == 0
                and s["num_held_blocks"] == 0
                for s in stats
            )
            if ready:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not idle after {timeout_s:.0f}s: {stats}")
            time.sleep(0.1)
