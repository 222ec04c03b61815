"""The router's text deltas (``pdserve.router.text.TextStream``) on the bundled model's real
tokenizer: what is streamed is always a prefix of the whole output's text and ends as all of
it, and a run of byte tokens that form no UTF-8 goes out within a few tokens, not when a valid
character finally follows."""

from __future__ import annotations

import random
from functools import cached_property

import pytest

from pdserve.engine.model.loader import bundled_model_path
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.router.text import MAX_HELD_TOKENS, TextStream


class _GenericDecoding(Tokenizer):
    """The bundled tokenizer without its table of token bytes: decoded by tokenizers'
    ``DecodeStream``, as a model with another decoder (SentencePiece's byte fallback) is."""

    @cached_property
    def token_bytes(self) -> None:
        return None


@pytest.fixture(scope="module", params=["byte-table", "decode-stream"])
def tokenizer(request) -> Tokenizer:
    bundled = Tokenizer.from_gguf(bundled_model_path())
    if request.param == "byte-table":
        assert bundled.token_bytes is not None
        return bundled
    return _GenericDecoding(
        bundled.backend, eos_token_id=bundled.eos_token_id, bos_token_id=bundled.bos_token_id
    )


def _byte_token(tokenizer: Tokenizer, byte: int) -> int | None:
    """The byte-level BPE token of one byte (GPT-2's byte-to-unicode alphabet); None for the
    bytes no UTF-8 text holds (0xC0, 0xC1, 0xF5-0xFF), which the vocabulary may lack."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    if byte in printable:
        char = chr(byte)
    else:
        char = chr(256 + [b for b in range(256) if b not in printable].index(byte))
    return tokenizer.token_to_id(char)


def _stream(tokenizer: Tokenizer, ids: list[int], step: int = 1) -> list[str]:
    text = TextStream(tokenizer)
    deltas = []
    for i in range(0, len(ids), step):
        chunk = ids[i : i + step]
        deltas.append(text.push(chunk, final=i + step >= len(ids)))
    return deltas


def test_streamed_text_is_always_a_prefix_of_the_whole_text(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.backend.get_vocab_size()
    byte_ids = [t for b in range(0x80, 0x100) if (t := _byte_token(tokenizer, b)) is not None]
    assert len(byte_ids) >= 0x70
    for n in range(300):
        length = rng.randrange(1, 120)
        # Random ids, and runs of raw bytes (pieces of characters, valid or not) among them.
        pool = byte_ids if n % 2 else list(range(vocab))
        ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(length)]
        deltas = _stream(tokenizer, ids, step=rng.choice([1, 1, 3]))
        whole = tokenizer.decode(ids)
        sent = ""
        for delta in deltas[:-1]:
            sent += delta
            assert whole.startswith(sent), (ids, sent, whole)
        assert sent + deltas[-1] == whole, ids


@pytest.mark.parametrize("length", [40, 300])
def test_bytes_that_are_no_utf8_are_not_held_until_the_end(tokenizer, length):
    # Continuation bytes with no lead byte: never a character, however many follow. A long run
    # too: its text must keep coming every few tokens (a client's gap SLO), not ever rarer.
    ids = [_byte_token(tokenizer, 0x80 + i % 0x40) for i in range(length)] + tokenizer.encode(" done")
    deltas = _stream(tokenizer, ids)
    silent = max(len(run) for run in "".join("x" if d else "." for d in deltas).split("x"))
    assert silent <= MAX_HELD_TOKENS, deltas
    assert "".join(deltas) == tokenizer.decode(ids)


def test_a_character_split_over_byte_tokens_is_still_sent_whole(tokenizer):
    ids = tokenizer.encode("a") + [_byte_token(tokenizer, b) for b in "😀".encode()] + tokenizer.encode("b")
    deltas = _stream(tokenizer, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids) == "a😀b"
