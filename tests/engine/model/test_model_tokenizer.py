"""The tokenizer rebuilt from the bundled GGUF, against transformers' and llama.cpp's splitting.

SmolLM's GGUF names llama.cpp pre-tokenizer "smollm": one digit per piece, then GPT-2's regex.
transformers 5.23 has no entry for "smollm" and splits with GPT-2's regex alone, so the two
differ exactly where two or more spaces precede a digit. We follow llama.cpp (and the model's
original tokenizer.json); elsewhere the ids must equal transformers' exactly.
"""

from __future__ import annotations

import os

import pytest

from pdserve.engine.model.gguf_loader import open_gguf
from pdserve.engine.model.loader import bundled_model_path
from pdserve.engine.model.tokenizer import Tokenizer, byte_alphabet

# Strings on which llama.cpp's "smollm" splitting and transformers' agree.
SHARED = [
    "Hello world",
    " hello  world ",
    "The capital of France is Paris.",
    "12345 and 2024, 3.14159e-10, -7 + 0x1F",
    "I'm sure you're right; they'll see we'd've done it",
    "café naïve ÀÉÎÕÜ ñ ß Straße",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "def f(x):\n    return x**2  # square\n\n\tdone\r\n",
    "a\n\n\nb   \n  c\t\td  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\u00a0nbsp and\u2003em-space",
    "",
    " ",
    "\n",
    "https://example.com/path?q=1&r=two#frag",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
]
# Two or more whitespace characters before a digit: llama.cpp keeps the run whole.
DIVERGENT = {
    "x  1": ["x", "ĠĠ", "1"],
    "   1. item": ["ĠĠĠ", "1", ".", "Ġitem"],
    "a\n  2": ["a", "ĊĠĠ", "2"],
}


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    path = bundled_model_path()
    return Tokenizer.from_gguf(path, reader=open_gguf(path))


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = bundled_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def llama_cpp_smollm_pieces(text: str) -> list[str]:
    """llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM split, reimplemented with the ``regex`` module:
    first ``\\p{N}`` (each digit its own piece), then GPT-2's regex on the rest."""
    regex = pytest.importorskip("regex")
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    pieces: list[str] = []
    for chunk in regex.split(r"(\p{N})", text):
        if chunk:
            pieces += gpt2.findall(chunk)
    alphabet = byte_alphabet()
    return ["".join(alphabet[b] for b in piece.encode("utf-8")) for piece in pieces]


def test_special_ids_and_vocab(ours):
    assert ours.vocab_size == 49152
    assert ours.eos_token_id == 2 and ours.eos_token == "<|im_end|>"
    assert ours.bos_token_id == 1 and ours.bos_token == "<|im_start|>"
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # GGUF: add_bos_token false


@pytest.mark.parametrize("text", SHARED + list(DIVERGENT))
def test_pre_tokenizer_splits_like_llama_cpp(ours, text):
    pieces = [piece for piece, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == llama_cpp_smollm_pieces(text)


@pytest.mark.parametrize("text", SHARED + list(DIVERGENT))
def test_decode_inverts_encode(ours, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_known_divergence_from_transformers_is_llama_cpp_grouping(ours):
    for text, tokens in DIVERGENT.items():
        assert [ours.backend.id_to_token(i) for i in ours.encode(text)] == tokens


def test_from_file_round_trips_the_backend(ours, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    ours.backend.save(path)
    loaded = Tokenizer.from_file(path)
    for text in SHARED:
        assert loaded.encode(text) == ours.encode(text)


@pytest.mark.slow
def test_ids_and_text_match_transformers(ours, hf_tokenizer):
    assert len(hf_tokenizer) == ours.vocab_size
    assert hf_tokenizer.eos_token_id == ours.eos_token_id
    for text in SHARED:
        expected = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True)
        assert ours.decode(expected, skip_special_tokens=False) == hf_tokenizer.decode(expected)
    for text in DIVERGENT:  # same text back, different grouping of spaces
        assert hf_tokenizer.decode(ours.encode(text)) == text
        assert ours.encode(text) != hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    prompt = ours.apply_chat_template(conversations[0])
    assert prompt.endswith("<|im_start|>assistant\n")
