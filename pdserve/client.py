"""``pdserve.client.Client``: a blocking Python client for the router.

    client = Client("127.0.0.1:8000")
    print(client.generate(prompt="The capital of France is", max_tokens=16).text)
    for delta in client.stream(prompt="Hello", request_id="my-id"):
        print(delta.text, end="", flush=True)

A router that wants a key gets it from ``api_key`` (default ``$PDSERVE_API_KEY``), sent as
``authorization: Bearer KEY`` metadata on every call (with no key at all, the first of
``$PDSERVE_API_KEYS``, the router's own setting); one that serves TLS is reached with
``tls=ClientTls(ca_certs=...)`` (``ClientTls()`` trusts the system's roots):

    client = Client("router.example:8000", api_key=key, tls=ClientTls(ca_certs="ca.pem"))

Bad sampling values raise ValueError before anything is sent. Errors from the server are
``grpc.RpcError`` with the router's status code (INVALID_ARGUMENT for bad input,
UNAVAILABLE when no engine can serve, RESOURCE_EXHAUSTED when the router is full,
UNAUTHENTICATED without an accepted key).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import Completion
from pdserve.engine.request import SamplingParams
from pdserve.router.auth import client_metadata
from pdserve.tls import ClientTls, grpc_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.wire import sampling_to_proto


@dataclass
class Delta:
    """One streamed message: new tokens, their text, and (last one only) why and how long."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)


class Client:
    def __init__(self, address: str, api_key: str | None = None, tls: ClientTls | None = None) -> None:
        self.address = address
        # Sent with every call (plain metadata, so it works over plaintext channels too).
        self._metadata = client_metadata(api_key)
        self.channel = grpc_channel(
            address,
            tls,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def stream(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
        chat: bool = False,
        priority: int = 0,
        stop: Sequence[str] = (),
        messages: Sequence[dict[str, str]] = (),
        **sampling: Any,
    ) -> Iterator[Delta]:
        """Yield deltas as tokens arrive; closing the iterator early cancels the request.

        ``sampling`` takes the other SamplingParams fields (presence_penalty, frequency_penalty,
        repetition_penalty, min_p, min_tokens). Values are validated here, before anything is
        sent: a bad one (max_tokens=0, temperature=-1, ...) raises ValueError naming the field.
        """
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
            **sampling,
        )
        if isinstance(stop, str):
            stop = [stop]
        request = router_pb2.GenerateRequest(
            request_id=request_id or f"cli-{uuid.uuid4().hex}",
            prompt=prompt or "",
            prompt_token_ids=list(prompt_token_ids or ()),
            sampling=sampling_to_proto(params),
            priority=priority,
            apply_chat_template=chat,
            messages=[router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            stop=list(stop),
        )
        call = self.stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for message in call:
                yield Delta(
                    request_id=message.request_id,
                    token_ids=list(message.token_ids),
                    text=message.text,
                    finish_reason=message.finish_reason or None,
                    metrics=_as_dict(message.metrics) if message.HasField("metrics") else {},
                )
        finally:
            call.cancel()  # a no-op once the stream has ended; cancels it if we stopped early

    def generate(
        self, prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> Completion:
        """Run one request to completion."""
        token_ids: list[int] = []
        text: list[str] = []
        finish_reason = None
        metrics: dict[str, Any] = {}
        request_id = ""
        for delta in self.stream(prompt, prompt_token_ids, **kwargs):
            request_id = delta.request_id
            token_ids.extend(delta.token_ids)
            text.append(delta.text)
            if delta.finish_reason:
                finish_reason, metrics = delta.finish_reason, delta.metrics
        return Completion(request_id, token_ids, "".join(text), finish_reason, metrics)

    def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        """Abort a running request everywhere; False if the router does not know it."""
        return self.stub.Abort(
            common_pb2.AbortRequest(request_id=request_id), timeout=timeout, metadata=self._metadata
        ).found

    def stats(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """One dict per engine: role, address, kv_usage, num_running, num_waiting, ..."""
        reply = self.stub.Stats(common_pb2.StatsRequest(), timeout=timeout, metadata=self._metadata)
        return [_as_dict(engine) for engine in reply.engines]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_dict(message: Any) -> dict[str, Any]:
    """A flat message as a dict of plain Python values (MessageToDict would stringify 64-bit
    ints); map fields (``timeline_ms``) become dicts."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        out[f.name] = (
            dict(value) if f.message_type is not None and f.message_type.GetOptions().map_entry else value
        )
    return out
