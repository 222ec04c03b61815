"""The OpenAI API's request bodies as pydantic models, and their translation to the router's
one request type (``router_pb2.GenerateRequest``).

Field names and meanings follow the OpenAI API reference and vLLM's OpenAI server, including
vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``). Unknown fields are refused, and
a known field pdserve does not support (``logprobs``, ``tools``, ...) is refused when set to
anything but its default: an SDK sends ``null`` or defaults, which must pass, but a value that
would change the answer must never be dropped silently.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pdserve.v1 import common_pb2, router_pb2

# Beyond this many choices per request (n x prompts) a request is refused.
MAX_CHOICES = 128


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "5" is not a number and 1 is not a bool (OpenAI refuses both); extra: unknown
    # fields are refused by name.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    include_stop_str_in_output: bool | None = False
    priority: int | None = 0
    return_token_ids: bool | None = False  # vLLM: each choice (and chunk) carries its token ids
    # Informational in OpenAI's API; they change nothing in the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Known but unsupported: refused unless null or the default (see ``unsupported``).
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    # {field: the values that mean "not used"}
    unsupported_defaults: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": (None, {}),
        "logprobs": (None, False),
    }

    def check_unsupported(self) -> None:
        given = self.model_fields_set
        for name, defaults in self.unsupported_defaults.items():
            if name in given and getattr(self, name) not in defaults:
                raise OpenAIError(
                    400, f"{name}: not supported by pdserve (leave it unset or null)", param=name
                )

    def num_choices(self) -> int:
        n = 1 if self.n is None else self.n
        if n < 1:
            raise OpenAIError(400, f"n: must be >= 1, got {n}", param="n")
        return n

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise OpenAIError(400, "stop: a stop string must not be empty", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_proto(self, max_tokens: int | None) -> common_pb2.SamplingParams:
        """The sampling message; unset fields stay unset and take the engine's defaults."""
        msg = common_pb2.SamplingParams(
            stop_token_ids=list(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos)
        )
        values = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            # vLLM reads top_k 0 as "disabled", like -1.
            "top_k": -1 if self.top_k == 0 else self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens or None,
        }
        for name, value in values.items():
            if value is None:
                continue
            _check_proto_range(name, value)
            setattr(msg, name, value)
        return msg


def _check_proto_range(name: str, value: Any) -> None:
    """Values the wire types cannot hold are refused here with the field's name (the full range
    checks, with the limits in the message, are the engine's SamplingParams.validate)."""
    if name in ("max_tokens", "min_tokens"):
        if not 0 <= value < 2**32:
            raise OpenAIError(
                400, f"{name}: must be >= {1 if name == 'max_tokens' else 0}, got {value}", param=name
            )
    elif name == "top_k":
        if not -(2**31) <= value < 2**31:
            raise OpenAIError(400, f"top_k: must be -1, 0 (disabled) or >= 1, got {value}", param=name)
    elif name == "seed":
        if not -(2**63) <= value < 2**63:
            raise OpenAIError(400, f"seed: must fit in 64 bits, got {value}", param=name)
    elif abs(value) > 3.4e38 or value != value:
        raise OpenAIError(400, f"{name}: {value} is not a finite 32-bit float", param=name)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    unsupported_defaults: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": (None, {}),
        "logprobs": (None,),
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    def prompts(self) -> list[router_pb2.GenerateRequest]:
        """One GenerateRequest per prompt (a batch of strings or of token-id lists)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]  # type: ignore[arg-type]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        requests = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise OpenAIError(400, "prompt: must not be empty", param="prompt")
                requests.append(router_pb2.GenerateRequest(prompt=item))
            else:
                if not item:
                    raise OpenAIError(400, "prompt: a token-id list must not be empty", param="prompt")
                if any(not 0 <= t < 2**63 for t in item):
                    raise OpenAIError(400, "prompt: token ids must be >= 0", param="prompt")
                requests.append(router_pb2.GenerateRequest(prompt_token_ids=item))
        return requests


class ChatMessageIn(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # OpenAI's tool and audio fields: refused when set (see ``text``).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    def text(self, index: int) -> str:
        """The message's text; refuses roles and fields pdserve does not support."""
        if self.role not in ("system", "developer", "user", "assistant"):
            raise OpenAIError(
                400,
                f"messages[{index}].role: {self.role!r} is not supported (system, developer, user, assistant)",
                param=f"messages[{index}].role",
            )
        for name in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(self, name) is not None:
                raise OpenAIError(
                    400,
                    f"messages[{index}].{name}: not supported by pdserve",
                    param=f"messages[{index}].{name}",
                )
        if self.content is None:
            raise OpenAIError(
                400, f"messages[{index}].content: is required", param=f"messages[{index}].content"
            )
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if (
                part.get("type") != "text"
                or not isinstance(part.get("text"), str)
                or set(part) - {"type", "text"}
            ):
                raise OpenAIError(
                    400,
                    f"messages[{index}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                    param=f"messages[{index}].content",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None

    unsupported_defaults: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": (None, {}),
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
        "response_format": (None, {"type": "text"}),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "prediction": (None,),
        "reasoning_effort": (None,),
        "web_search_options": (None,),
    }

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; either is accepted.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def generate_request(self) -> router_pb2.GenerateRequest:
        messages = []
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role
            messages.append(router_pb2.ChatMessage(role=role, content=message.text(i)))
        return router_pb2.GenerateRequest(messages=messages)
