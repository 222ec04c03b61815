"""The messages between an engine's front process and its core process, and their wire format.

Every message is a dataclass below, sent as a msgpack map of its fields plus ``type``; no
pickle. Decoding is strict: a map with an unknown type, an unknown or missing field, or a value
of the wrong type raises ValueError naming it, so a renamed field fails loudly on both sides
instead of reading as a default. The encoding follows each dataclass's fields (including the
ones nested in it: ``SamplingParams``, ``EngineCoreOutput``, ``SchedulerStats``), so a field
added there crosses without further edits.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from pdserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pdserve.engine.request import SamplingParams

# ---------------------------------------------------------------------- front -> core


@dataclass(frozen=True)
class AddRequest:
    TYPE: ClassVar[str] = "add"

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    priority: int
    arrival_time: float


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[str] = "abort"

    request_ids: list[str]


@dataclass(frozen=True)
class StatsQuery:
    """Answered with a ``StatsReply`` carrying the same nonce."""

    TYPE: ClassVar[str] = "stats"

    nonce: int


@dataclass(frozen=True)
class ResetPrefixCache:
    """Answered with a ``ResetPrefixCacheReply`` carrying the same nonce."""

    TYPE: ClassVar[str] = "reset_prefix_cache"

    nonce: int


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


# ---------------------------------------------------------------------- core -> front


@dataclass(frozen=True)
class CoreInfo:
    """What the core tells its front once the model is loaded."""

    vocab_size: int
    eos_token_id: int | None
    max_model_len: int
    num_blocks: int
    block_size: int
    connector: dict[str, Any] | None  # the connector's ``describe()``; None without one
    dtype: str  # what the weights and KV cache are in ("auto" resolved)
    torch_threads: int  # torch's intra-op threads in the core
    cpus: str  # the core's affinity, as a cpu list ("0-3,6")
    quantization: str = "none"  # --quantization
    weights: str = ""  # what the weights are held as ("Q4_1 x210, Q8_0 x1, bfloat16")
    weight_bytes: int = 0  # their bytes in memory
    instance_id: str = ""  # random per core start: a restarted engine is a new instance
    kv_events_port: int = 0  # its KV-event PUB port; 0: events off
    kv_events_replay_port: int = 0  # and its replay ROUTER port


@dataclass(frozen=True)
class Ready:
    TYPE: ClassVar[str] = "ready"

    info: CoreInfo


@dataclass(frozen=True)
class Outputs:
    TYPE: ClassVar[str] = "outputs"

    outputs: list[EngineCoreOutput]


@dataclass(frozen=True)
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"

    nonce: int
    stats: SchedulerStats


@dataclass(frozen=True)
class ResetPrefixCacheReply:
    TYPE: ClassVar[str] = "reset_prefix_cache_reply"

    nonce: int
    ok: bool  # False: some block was still in use, nothing was reset


FrontMessage = AddRequest | Abort | StatsQuery | ResetPrefixCache | Shutdown
CoreMessage = Ready | Outputs | StatsReply | ResetPrefixCacheReply
Query = StatsQuery | ResetPrefixCache
Reply = StatsReply | ResetPrefixCacheReply

# {type: message class}, one table a direction: each side accepts only what the other sends.
_FROM_FRONT = {cls.TYPE: cls for cls in typing.get_args(FrontMessage)}
_FROM_CORE = {cls.TYPE: cls for cls in typing.get_args(CoreMessage)}


# ---------------------------------------------------------------------- encoding


def encode(message: FrontMessage | CoreMessage) -> bytes:
    return msgpack.packb({"type": message.TYPE, **_to_plain(message)}, use_bin_type=True)


def decode_from_front(data: bytes) -> FrontMessage:
    """What the core reads; ValueError if ``data`` is not exactly one of the front's messages."""
    return _decode(data, _FROM_FRONT)


def decode_from_core(data: bytes) -> CoreMessage:
    """What the front reads; ValueError if ``data`` is not exactly one of the core's messages."""
    return _decode(data, _FROM_CORE)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _decode(data: bytes, accepted: dict[str, type]) -> Any:
    try:
        plain = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ValueError(f"malformed message: {exc}") from None
    if not isinstance(plain, dict) or not isinstance(plain.get("type"), str):
        raise ValueError("malformed message: expected a map with a string 'type'")
    kind = plain.pop("type")
    cls = accepted.get(kind)
    if cls is None:
        raise ValueError(f"malformed message: unexpected type {kind!r}")
    return _build(cls, plain, kind)


def _build(cls: type, plain: Any, where: str) -> Any:
    """``cls(**plain)`` once every field is present, known and of its declared type."""
    if not isinstance(plain, dict):
        raise ValueError(f"{where}: expected a map, got {type(plain).__name__}")
    hints = _field_types(cls)
    unknown = sorted(set(plain) - set(hints), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}")
    missing = [name for name in hints if name not in plain]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    values = {name: _convert(plain[name], hint, f"{where}.{name}") for name, hint in hints.items()}
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """{field name: its type}, for the fields the constructor takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


@functools.cache
def _shape(hint: Any) -> tuple[Any, tuple[Any, ...], bool]:
    """A field type's origin, arguments and whether it is a dataclass: worked out once per type
    (the front decodes every step's outputs)."""
    is_dataclass = isinstance(hint, type) and dataclasses.is_dataclass(hint)
    return typing.get_origin(hint), typing.get_args(hint), is_dataclass


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` as ``hint`` asks (nested dataclasses built, sequences as lists or tuples)."""
    origin, args, is_dataclass = _shape(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ValueError:
                pass
        raise ValueError(f"{where}: {value!r} is not {hint}")
    if is_dataclass:
        return _build(hint, value, where)
    if origin in (list, tuple, Sequence):
        _expect(isinstance(value, list | tuple), value, hint, where)
        if not args or (args[0] in (int, str) and all(type(v) is args[0] for v in value)):
            items = list(value)  # the common case (token ids), checked in one pass
        else:
            items = [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if hint is dict or origin is dict:
        _expect(isinstance(value, dict), value, hint, where)
        if not args:
            return value
        return {
            _convert(k, args[0], where): _convert(v, args[1], f"{where}[{k!r}]") for k, v in value.items()
        }
    if hint is bool:
        _expect(isinstance(value, bool), value, hint, where)
    elif hint is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), value, hint, where)
    elif hint is float:
        _expect(isinstance(value, int | float) and not isinstance(value, bool), value, hint, where)
        return float(value)
    elif hint is str:
        _expect(isinstance(value, str), value, hint, where)
    else:
        raise TypeError(f"{where}: no wire form for {hint!r}")  # a message type this module can't carry
    return value


def _expect(ok: bool, value: Any, hint: Any, where: str) -> None:
    if not ok:
        raise ValueError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
