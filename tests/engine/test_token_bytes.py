"""A byte-level tokenizer's table of token bytes (``pdserve.engine.model.token_bytes``) decodes as
tokenizers does: each token alone as ``decode``, and a stream of them step by step as
``DecodeStream`` (the same text at every step, None where it holds an incomplete character),
on the bundled model's tokenizer and the tiny test model's. Another decoder gets no table."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models
from tokenizers.decoders import DecodeStream

from pdserve.engine.model.gguf_tokenizer import byte_alphabet
from pdserve.engine.model.loader import bundled_model_path, load_tokenizer
from pdserve.engine.model.token_bytes import TokenBytes
from pdserve.engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["bundled", "tiny"])
def tokenizer(request, tiny_model_dir) -> Tokenizer:
    if request.param == "bundled":
        return Tokenizer.from_gguf(bundled_model_path())
    return load_tokenizer(tiny_model_dir)


def test_each_token_alone_decodes_as_the_tokenizer_decodes_it(tokenizer):
    table = tokenizer.token_bytes
    assert table is not None
    backend = tokenizer.backend
    size = backend.get_vocab_size(with_added_tokens=True)
    assert len(table.bytes_of) == size
    wrong = [
        i
        for i in range(size)
        if table.bytes_of[i].decode("utf-8", "replace") != backend.decode([i], skip_special_tokens=True)
    ]
    assert not wrong, [(i, backend.id_to_token(i)) for i in wrong[:10]]


def _ids(tokenizer: Tokenizer, table: TokenBytes, rng: random.Random, n: int) -> list[int]:
    """Ordinary tokens, special ones, and many single high bytes: characters split across
    tokens, and byte runs that form no UTF-8."""
    size = len(table.bytes_of)
    high = [i for i, data in enumerate(table.bytes_of) if len(data) == 1 and data[0] >= 0x80]
    special = [i for i in range(size) if not table.bytes_of[i] and tokenizer.backend.id_to_token(i)]
    picks = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            picks.append(rng.choice(high))
        elif kind < 0.5 and special:
            picks.append(rng.choice(special))
        else:
            picks.append(rng.randrange(size))
    return picks


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_stream_decodes_step_by_step_as_decode_stream(tokenizer, per_step):
    table = tokenizer.token_bytes
    assert table is not None
    rng = random.Random(per_step)
    for _ in range(40):
        ids = _ids(tokenizer, table, rng, 60)
        ours, theirs = table.stream(), DecodeStream(skip_special_tokens=True)
        for start in range(0, len(ids), per_step):
            step = ids[start : start + per_step]
            assert ours.step(step) == theirs.step(tokenizer.backend, step), (ids, start)


def test_an_id_past_the_vocabulary_adds_no_text(tokenizer):
    table = tokenizer.token_bytes
    assert table is not None
    stream = table.stream()
    hello = tokenizer.encode("Hello")
    assert stream.step([len(table.bytes_of) + 5]) is None
    assert stream.step(hello) == "Hello"


def test_ids_past_the_token_count_are_in_the_table():
    """A tokenizer.json may leave gaps in its ids: the table runs to the highest one."""
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)} | {alphabet[ord(" ")] + "hello": 300}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>"])
    table = TokenBytes.of(backend)
    assert table is not None and len(table.bytes_of) > 300
    assert (
        table.stream().step([300]) == " hello" == DecodeStream(skip_special_tokens=True).step(backend, [300])
    )


def test_a_tokenizer_without_a_byte_level_decoder_gets_no_table():
    backend = BackendTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    assert TokenBytes.of(backend) is None
    assert Tokenizer(backend).token_bytes is None
