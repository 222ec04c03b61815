from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "priority", "apply_chat_template", "messages", "stop", "include_stop_str_in_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    apply_chat_template: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., apply_chat_template: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("ttft_ms", "prefill_ms", "transfer_ms", "decode_ms", "queue_ms", "prefill_engine", "decode_engine", "num_cached_tokens", "num_prompt_tokens", "stop_reason", "timeline_ms", "expected_prefill_hit_blocks", "prefill_hit_blocks", "expected_decode_hit_blocks", "decode_hit_blocks", "decode_pulled_blocks")
    class TimelineMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PREFILL_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DECODE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    prefill_ms: float
    transfer_ms: float
    decode_ms: float
    queue_ms: float
    prefill_engine: str
    decode_engine: str
    num_cached_tokens: int
    num_prompt_tokens: int
    stop_reason: str
    timeline_ms: _containers.ScalarMap[str, float]
    expected_prefill_hit_blocks: int
    prefill_hit_blocks: int
    expected_decode_hit_blocks: int
    decode_hit_blocks: int
    decode_pulled_blocks: int
    def __init__(self, ttft_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., prefill_engine: _Optional[str] = ..., decode_engine: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., stop_reason: _Optional[str] = ..., timeline_ms: _Optional[_Mapping[str, float]] = ..., expected_prefill_hit_blocks: _Optional[int] = ..., prefill_hit_blocks: _Optional[int] = ..., expected_decode_hit_blocks: _Optional[int] = ..., decode_hit_blocks: _Optional[int] = ..., decode_pulled_blocks: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "metrics")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[_common_pb2.EngineStats]
    def __init__(self, engines: _Optional[_Iterable[_Union[_common_pb2.EngineStats, _Mapping]]] = ...) -> None: ...
