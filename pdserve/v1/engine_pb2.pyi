from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "kv_transfer_params", "num_prior_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    kv_transfer_params: _common_pb2.KVTransferParams
    num_prior_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., num_prior_output_tokens: _Optional[int] = ...) -> None: ...

class EngineGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "kv_transfer_params", "num_cached_tokens", "error", "timeline", "num_prefix_hit_tokens")
    class TimelineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    kv_transfer_params: _common_pb2.KVTransferParams
    num_cached_tokens: int
    error: str
    timeline: _containers.ScalarMap[str, float]
    num_prefix_hit_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., timeline: _Optional[_Mapping[str, float]] = ..., num_prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "abort_request_id")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    generate: EngineGenerateRequest
    abort_request_id: str
    def __init__(self, generate: _Optional[_Union[EngineGenerateRequest, _Mapping]] = ..., abort_request_id: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("outputs", "errors", "aborted")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineGenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineGenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("role", "model", "vocab_size", "eos_token_id", "max_model_len", "block_size", "num_blocks", "engine_id", "kv_transport", "dtype", "torch_threads", "cpus", "quantization", "weights", "weight_bytes", "instance_id", "kv_events_port", "kv_events_replay_port", "session_port")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TORCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    vocab_size: int
    eos_token_id: int
    max_model_len: int
    block_size: int
    num_blocks: int
    engine_id: str
    kv_transport: str
    dtype: str
    torch_threads: int
    cpus: str
    quantization: str
    weights: str
    weight_bytes: int
    instance_id: str
    kv_events_port: int
    kv_events_replay_port: int
    session_port: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., engine_id: _Optional[str] = ..., kv_transport: _Optional[str] = ..., dtype: _Optional[str] = ..., torch_threads: _Optional[int] = ..., cpus: _Optional[str] = ..., quantization: _Optional[str] = ..., weights: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., kv_events_port: _Optional[int] = ..., kv_events_replay_port: _Optional[int] = ..., session_port: _Optional[int] = ...) -> None: ...
