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
from collections.abc import Callable, Sequence
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
class Drain:
    """The engine is draining: the core refuses its framed sessions' new requests with
    ``message`` (UNAVAILABLE) and closes each session once nothing of it runs."""

    TYPE: ClassVar[str] = "drain"

    message: str


@dataclass(frozen=True)
class StatsQuery:
    """Answered with a ``StatsReply`` carrying the same nonce."""

    TYPE: ClassVar[str] = "stats"

    nonce: int


@dataclass(frozen=True)
class AbortTaken:
    """An abort answered with an ``AbortTakenReply`` as soon as the core has taken it in, so
    the sender knows that whatever reaches the core after the reply (a framed session's new
    request reusing the id) is handled after the abort."""

    TYPE: ClassVar[str] = "abort_taken"

    nonce: int
    request_ids: list[str]


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
class AbortTakenReply:
    TYPE: ClassVar[str] = "abort_taken_reply"

    nonce: int


@dataclass(frozen=True)
class ResetPrefixCacheReply:
    TYPE: ClassVar[str] = "reset_prefix_cache_reply"

    nonce: int
    ok: bool  # False: some block was still in use, nothing was reset


FrontMessage = AddRequest | Abort | AbortTaken | Drain | StatsQuery | ResetPrefixCache | Shutdown
CoreMessage = Ready | Outputs | StatsReply | AbortTakenReply | ResetPrefixCacheReply
Query = StatsQuery | ResetPrefixCache
Reply = StatsReply | AbortTakenReply | ResetPrefixCacheReply

# {type: message class}, one table a direction: each side accepts only what the other sends.
_FROM_FRONT = {cls.TYPE: cls for cls in typing.get_args(FrontMessage)}
_FROM_CORE = {cls.TYPE: cls for cls in typing.get_args(CoreMessage)}


# ---------------------------------------------------------------------- encoding


def encode(message: FrontMessage | CoreMessage) -> bytes:
    cls: type = type(message)
    plain = _plainer(cls)(message)
    plain["type"] = message.TYPE
    return msgpack.packb(plain, use_bin_type=True)


def decode_from_front(data: bytes) -> FrontMessage:
    """What the core reads; ValueError if ``data`` is not exactly one of the front's messages."""
    return _decode(data, _FROM_FRONT)


def decode_from_core(data: bytes) -> CoreMessage:
    """What the front reads; ValueError if ``data`` is not exactly one of the core's messages."""
    return _decode(data, _FROM_CORE)


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
    try:
        return _builder(cls)(plain)
    except _WireError as exc:
        raise ValueError(f"{kind}{exc.path}: {exc.problem}") from None


# ---------------------------------------------------------------------- compiled per type
#
# The front decodes every step's outputs (and the core encodes them): each dataclass's checks
# and conversions are worked out once, into one function per type, rather than from its type
# hints on every message. Where a value is wrong is only spelled out when it is.


class _WireError(ValueError):
    """A value not of its field's type; ``path`` grows as the error leaves nested values."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(problem)
        self.problem, self.path = problem, path

    def under(self, step: str) -> _WireError:
        return _WireError(self.problem, step + self.path)


Converter = Callable[[Any], Any]


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """{field name: its type}, for the fields the constructor takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


@functools.cache
def _builder(cls: type) -> Converter:
    """A function making ``cls(**plain)`` once every field is present, known and of its
    declared type (nested dataclasses built, sequences as lists or tuples)."""
    fields = tuple((name, _converter(hint)) for name, hint in _field_types(cls).items())
    names = frozenset(name for name, _ in fields)

    def build(plain: Any) -> Any:
        if type(plain) is not dict:
            raise _WireError(f"expected a map, got {type(plain).__name__}")
        if plain.keys() != names:
            unknown = sorted(set(plain) - names, key=str)
            if unknown:
                raise _WireError(f"unknown fields {unknown}")
            raise _WireError(f"missing fields {[name for name, _ in fields if name not in plain]}")
        values = {}
        for name, convert in fields:
            try:
                values[name] = convert(plain[name])
            except _WireError as exc:
                raise exc.under(f".{name}") from None
        try:
            return cls(**values)
        except TypeError as exc:
            raise _WireError(str(exc)) from None

    return build


def _identity(value: Any) -> Any:
    return value


def _converter(hint: Any) -> Converter:
    """A function checking (and, where needed, converting) one value of type ``hint``."""
    if hint is Any:
        return _identity
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return _union(hint, args)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _builder(hint)
    if origin in (list, tuple, Sequence):
        return _sequence(hint, origin, args[0] if args else Any)
    if hint is dict or origin is dict:
        return _mapping(hint, args)
    return _scalar(hint)


def _union(hint: Any, args: tuple[Any, ...]) -> Converter:
    optional = type(None) in args
    options = [_converter(arg) for arg in args if arg is not type(None)]

    def convert(value: Any) -> Any:
        if value is None and optional:
            return None
        for option in options:
            try:
                return option(value)
            except _WireError:
                pass
        raise _WireError(f"{value!r} is not {hint}")

    return convert


def _sequence(hint: Any, origin: Any, item_hint: Any) -> Converter:
    item = _converter(item_hint)
    plain_items = item_hint in (int, str)  # the common case (token ids), checked in one pass
    as_list = origin is list

    def convert(value: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise _WireError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
        if item_hint is Any or (plain_items and all(type(v) is item_hint for v in value)):
            items = list(value)
        else:
            items = []
            for i, v in enumerate(value):
                try:
                    items.append(item(v))
                except _WireError as exc:
                    raise exc.under(f"[{i}]") from None
        return items if as_list else tuple(items)

    return convert


def _mapping(hint: Any, args: tuple[Any, ...]) -> Converter:
    key, item = (_converter(args[0]), _converter(args[1])) if args else (None, None)

    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _WireError(f"expected dict, got {type(value).__name__}")
        if key is None or item is None:
            return value
        converted = {}
        for k, v in value.items():
            try:
                converted[key(k)] = item(v)
            except _WireError as exc:
                raise exc.under(f"[{k!r}]") from None
        return converted

    return convert


def _scalar(hint: Any) -> Converter:
    if hint is bool:

        def convert(value: Any) -> Any:
            if type(value) is not bool:
                raise _WireError(f"expected bool, got {type(value).__name__}")
            return value

    elif hint is int:

        def convert(value: Any) -> Any:
            if not isinstance(value, int) or isinstance(value, bool):
                raise _WireError(f"expected int, got {type(value).__name__}")
            return value

    elif hint is float:

        def convert(value: Any) -> Any:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _WireError(f"expected float, got {type(value).__name__}")
            return float(value)

    elif hint is str:

        def convert(value: Any) -> Any:
            if not isinstance(value, str):
                raise _WireError(f"expected str, got {type(value).__name__}")
            return value

    else:
        raise TypeError(f"no wire form for {hint!r}")  # a message type this module can't carry
    return convert


@functools.cache
def _plainer(cls: type) -> Converter:
    """A function giving a dataclass's fields as a map of msgpack's plain values (nested
    dataclasses as maps, tuples as lists)."""
    fields = tuple(
        (f.name, _to_plain_hinted(_field_types(cls).get(f.name, Any))) for f in dataclasses.fields(cls)
    )

    def plain(value: Any) -> dict[str, Any]:
        return {name: convert(getattr(value, name)) for name, convert in fields}

    return plain


def _to_plain_hinted(hint: Any) -> Converter:
    """How a field of type ``hint`` goes to msgpack: primitives (and lists of them) as they are."""
    if hint in (int, float, str, bool) or hint == list[int] or hint == list[str]:
        return _identity
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and all(
        a in (int, float, str, bool, type(None)) for a in args
    ):
        return _identity
    return _to_plain


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plainer(type(value))(value)
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value
