"""Each token's bytes, for decoding a byte-level BPE model's output a token at a time.

The router turns every streamed token into text. tokenizers' ``DecodeStream`` does that
generically (it decodes a window of ids through the model and decoder at each step), which costs
about 14 us of the router's CPU per token on two busy cores; a byte-level decoder
(GPT-2's: SmolLM2, Llama 3, Qwen) only concatenates each token's bytes and reads them as UTF-8,
so a table of those bytes (and of the text of each token that is whole UTF-8 on its own) gives
the same text for a list lookup. Other decoders (SentencePiece's byte fallback, say) get None and
keep ``DecodeStream``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from pdserve.engine.model.gguf_tokenizer import byte_alphabet

REPLACEMENT = "\ufffd"


class TokenBytes:
    """``bytes_of[id]``: the bytes a token adds to decoded text ('' for a special token, which
    decoding skips); ``text_of[id]``: those bytes as text when they are whole UTF-8 on their
    own (else None)."""

    def __init__(self, bytes_of: list[bytes]) -> None:
        self.bytes_of = bytes_of
        self.text_of: list[str | None] = []
        for data in bytes_of:
            text = data.decode("utf-8", "replace")
            self.text_of.append(None if text.endswith(REPLACEMENT) else text)

    @classmethod
    def of(cls, backend: BackendTokenizer) -> TokenBytes | None:
        """The table of a tokenizer with a byte-level decoder, or None for another decoder."""
        if not isinstance(backend.decoder, decoders.ByteLevel):
            return None
        byte_of_char = {char: byte for byte, char in byte_alphabet().items()}
        spelled = frozenset(byte_of_char)
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        vocab = backend.get_vocab(with_added_tokens=True)
        # Past the highest id, not the token count: a tokenizer.json's ids may leave gaps.
        bytes_of = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            if i in special:
                continue
            # As tokenizers' ByteLevel decoder: a token spelled in the byte alphabet is its
            # bytes; any other (an added token's raw text) is its own UTF-8.
            if set(token) <= spelled:
                bytes_of[i] = bytes(byte_of_char[c] for c in token)
            else:
                bytes_of[i] = token.encode("utf-8")
        return cls(bytes_of)

    def stream(self) -> ByteStream:
        return ByteStream(self)


class ByteStream:
    """``DecodeStream``'s contract on a ``TokenBytes`` table: ``step(ids)`` gives the text the
    ids add, or None while that text is empty or ends in U+FFFD (a character not yet whole);
    such ids stay pending and come out with the next step that completes them."""

    def __init__(self, table: TokenBytes) -> None:
        self._bytes_of = table.bytes_of
        self._text_of = table.text_of
        self._pending = b""

    def idle(self) -> bool:
        """True when no bytes wait for the rest of their character."""
        return not self._pending

    def step(self, ids: Sequence[int]) -> str | None:
        size = len(self._bytes_of)
        if not self._pending and len(ids) == 1 and 0 <= ids[0] < size:
            text = self._text_of[ids[0]]
            if text is not None:
                return text or None
        # An id past the table (a model's padding row) decodes to nothing, as tokenizers' does.
        data = self._pending + b"".join(self._bytes_of[i] for i in ids if 0 <= i < size)
        text = data.decode("utf-8", "replace")
        if not text or text.endswith(REPLACEMENT):
            self._pending = data
            return None
        self._pending = b""
        return text
