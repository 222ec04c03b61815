"""The C relay of a streaming answer's plain tokens (``pdserve/router/csrc/token_relay.c``).

On two cores shared with the engines, relaying a token in Python cost the router about 20 us of
CPU more than the work itself: the session's frame, the request's text stream, the SSE chunk and
uvicorn's transport are some fifty objects, and the engines' weights evict them between two
tokens of a request. The C relay reads an engine's frame and writes each plain token's chunk to
its client's socket itself, from a few cache lines a request (docs/performance.md).

Python keeps every decision: which requests the relay holds (``register``: a streaming answer
with no stop strings, on a plain-HTTP connection), and when (``activate``: only while Python's
side of the request is idle and in step: nothing queued, no partial character held, the client's
transport empty). The relay declines every output that is not plain tokens of an active request
(a first token, a finish, a timeline, an error, a token with no whole text of its own), and
stops relaying that request until Python activates it again; ``take`` gives Python what the relay
sent meanwhile (ids, text, inter-token gaps), so the request's text, its resume point, its usage
and the ITL histogram are the same as if Python had sent every token.

Where no C compiler builds it (``pdserve.kernels.cpu.build``), or with ``--no-token-relay``,
Python relays every token, as before.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from pdserve.engine.model.token_bytes import TokenBytes
from pdserve.kernels.cpu.build import CLibrary

_c_int32_p = ctypes.POINTER(ctypes.c_int32)
# An output index per output of a frame: a step's outputs are one per running request.
MAX_OUTPUTS = 4096


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_char_p, c_double, c_int64 = ctypes.c_int, ctypes.c_char_p, ctypes.c_double, ctypes.c_int64
    ptr = ctypes.POINTER
    lib.relay_new_table.argtypes = [ctypes.c_int32, c_char_p, _c_int32_p, c_char_p, _c_int32_p]
    lib.relay_new_table.restype = ctypes.c_void_p
    lib.relay_free_table.argtypes = [ctypes.c_void_p]
    lib.relay_free_table.restype = None
    key: list[Any] = [c_int, c_char_p, c_int]  # an engine session's number and a request id's bytes
    lib.relay_register.argtypes = [*key, ctypes.c_void_p, c_int, c_char_p, c_int, c_char_p, c_int]
    lib.relay_register.restype = c_int
    lib.relay_activate.argtypes = [*key, c_double, c_int64]
    lib.relay_activate.restype = c_int
    lib.relay_counts.argtypes = [*key, _c_int32_p, _c_int32_p, ptr(c_int64), ptr(c_int64), ptr(c_double)]
    lib.relay_counts.restype = c_int
    lib.relay_take.argtypes = [*key, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.relay_take.restype = None
    lib.relay_unregister.argtypes = key
    lib.relay_unregister.restype = None
    lib.relay_frame.argtypes = [c_int, c_char_p, c_int64, _c_int32_p, ctypes.c_int32, _c_int32_p, _c_int32_p]
    lib.relay_frame.restype = c_int


LIBRARY = CLibrary(
    ["token_relay"],
    _declare,
    "the router's token relay",
    root=Path(__file__).parent / "csrc",
    fallback="every token is relayed in Python",
)
_session_numbers = itertools.count(1)


class FrameRelay:
    """An engine session's frames through the relay (one for the process)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._frame = lib.relay_frame
        self._declined = (ctypes.c_int32 * MAX_OUTPUTS)()
        self._flush = (ctypes.c_int32 * MAX_OUTPUTS)()
        self._n_flush = ctypes.c_int32()
        self._n_flush_ref = ctypes.byref(self._n_flush)

    def frame(self, session: int, payload: bytes) -> tuple[list[int], list[int]] | None:
        """Relay what it can of an engine's ``SessionResponse``: None when all of it is Python's
        (nothing was relayed), else the indexes of its outputs declined (Python handles those)
        and of those whose chunk went out in part (Python takes them at once: see ``take``)."""
        declined = self._frame(
            session, payload, len(payload), self._declined, MAX_OUTPUTS, self._flush, self._n_flush_ref
        )
        if declined < 0:
            return None
        flushed = self._flush[: self._n_flush.value] if self._n_flush.value else []
        return (self._declined[:declined] if declined else []), flushed


_frames: FrameRelay | None = None


def frames() -> FrameRelay | None:
    """The process's frame relay, once a router has made a ``TokenRelay`` (else None)."""
    return _frames


def new_session_number() -> int:
    """A number for an engine session, unique in this process: a request id is held per session."""
    return next(_session_numbers)


@dataclass
class Relayed:
    """What the relay sent for a request since Python last took it."""

    token_ids: list[int]
    text: str
    gaps: list[float]  # seconds between each output and the one before it
    last_at: float  # ``time.perf_counter()`` of its last output
    rest: bytes  # a chunk's bytes the socket did not take: for the transport, before anything else


class TokenRelay:
    """The relay, with one tokenizer's table of token texts (the relay's requests are the
    process's; each router has its own table, which lives as long as the router: a request's
    slot points into it)."""

    def __init__(self, lib: ctypes.CDLL, table: TokenBytes) -> None:
        self.lib = lib
        json_parts, raw_parts, json_off, raw_off = [], [], [0], [0]
        for text in table.text_of:
            # Only a token that is whole UTF-8 on its own, and not empty, is relayed: one that
            # is not yet a character (or a special token's nothing) is Python's to hold back.
            escaped, raw = (orjson.dumps(text)[1:-1], text.encode()) if text else (b"", b"")
            json_parts.append(escaped)
            raw_parts.append(raw)
            json_off.append(json_off[-1] + len(escaped))
            raw_off.append(raw_off[-1] + len(raw))
        # Kept here: the library reads them in place.
        self._json = b"".join(json_parts)
        self._raw = b"".join(raw_parts)
        self._json_off = (ctypes.c_int32 * len(json_off))(*json_off)
        self._raw_off = (ctypes.c_int32 * len(raw_off))(*raw_off)
        self._table = lib.relay_new_table(
            len(table.text_of), self._json, self._json_off, self._raw, self._raw_off
        )
        if not self._table:
            raise MemoryError("the token relay's table")

    @classmethod
    def load(cls, table: TokenBytes | None) -> TokenRelay | None:
        """The relay for a byte-level tokenizer's ``table``, or None (another decoder, or no C
        library here: logged once by the library). From then on the process's engine sessions
        hand their frames to the relay (``frames``)."""
        global _frames
        if table is None or not LIBRARY.available():
            return None
        lib = LIBRARY.load()
        if _frames is None:
            _frames = FrameRelay(lib)
        return cls(lib, table)

    def __del__(self) -> None:
        if getattr(self, "_table", None):
            self.lib.relay_free_table(self._table)

    def register(self, session: int, request_id: bytes, fd: int, head: bytes, tail: bytes) -> bool:
        """Hold a request whose chunks are ``head`` + the text as a JSON string + ``tail``, for
        the client socket ``fd`` (duplicated: a descriptor closed meanwhile is never written)."""
        lib = self.lib
        n = len(request_id)
        return (
            lib.relay_register(session, request_id, n, self._table, fd, head, len(head), tail, len(tail)) == 0
        )

    def activate(self, session: int, request_id: bytes, last_at: float, cached_tokens: int) -> None:
        """Relay the request's next outputs (``last_at``: its last token's time, for the next
        gap; ``cached_tokens``: the cached-token count Python has seen, a larger one is Python's)."""
        self.lib.relay_activate(session, request_id, len(request_id), last_at, cached_tokens)

    def take(self, session: int, request_id: bytes) -> Relayed | None:
        """Stop relaying the request, and what it sent since the last take (None: nothing)."""
        n_ids, n_gaps = ctypes.c_int32(), ctypes.c_int32()
        text_len, rest_len, last_at = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_double()
        found = self.lib.relay_counts(
            session, request_id, len(request_id), ctypes.byref(n_ids), ctypes.byref(n_gaps),
            ctypes.byref(text_len), ctypes.byref(rest_len), ctypes.byref(last_at),
        )  # fmt: skip
        if found < 0 or not (n_ids.value or rest_len.value):
            return None
        ids = (ctypes.c_int64 * n_ids.value)()
        gaps = (ctypes.c_double * n_gaps.value)()
        text = ctypes.create_string_buffer(text_len.value or 1)
        rest = ctypes.create_string_buffer(rest_len.value or 1)
        self.lib.relay_take(session, request_id, len(request_id), ids, gaps, text, rest)
        return Relayed(
            token_ids=list(ids),
            text=text.raw[: text_len.value].decode(),
            gaps=list(gaps),
            last_at=last_at.value,
            rest=rest.raw[: rest_len.value],
        )

    def unregister(self, session: int, request_id: bytes) -> None:
        """Let go of the request (take first: what it sent since the last take is dropped)."""
        self.lib.relay_unregister(session, request_id, len(request_id))
