"""Text <-> token ids, and chat prompts, over a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types and the name
of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). ``Tokenizer.from_gguf`` rebuilds the
byte-level BPE from those. The pre-tokenizer is chosen the way llama.cpp chooses its regexes for
that name, because that is how the model's training text was split. For SmolLM ("smollm") that
is StarCoder's: digits split one by one, then GPT-2's byte-level regex. (transformers 5.23 does
not know "smollm" and falls back to plain GPT-2 splitting, which differs only in how a run of
two or more spaces before a digit is grouped: ``"x  1"`` -> ``x|ĠĠ|1`` here, ``x|Ġ|Ġ|1`` there.)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pdserve.engine.model.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp pre-tokenizer names whose first regex is "\p{N}" (one digit per piece), then GPT-2's.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == pre``."""
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2:
        logger.warning("unknown tokenizer.ggml.pre %r: using GPT-2 byte-level splitting", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the spelling of byte-level vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards in order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _spell_byte_level(token: str, spelled: frozenset[str]) -> str:
    # Vocabulary entries are stored byte-level-spelled; an entry using other characters
    # (a raw special token) is re-spelled so BPE can still find it.
    if set(token) <= spelled:
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids and chat template the engine needs."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's Jinja chat template (as transformers does)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    # ---- builders -----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str, reader: GGUFFile | None = None) -> Tokenizer:
        """Rebuild a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) from GGUF metadata."""
        reader = reader if reader is not None else GGUFFile(path)

        def get(key: str, default: Any = None) -> Any:
            return reader.field(f"tokenizer.{key}", default)

        kind = get("ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2')")
        tokens: list[str] = get("ggml.tokens")
        types: list[int] = get("ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in get("ggml.merges", [])]
        spelled = frozenset(byte_alphabet().values())
        vocab = {_spell_byte_level(tok, spelled): i for i, tok in enumerate(tokens)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = byte_level_pre_tokenizer(get("ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, ...) must match whole in text and be skippable on decode.
        backend.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )
        bos, eos = get("ggml.bos_token_id"), get("ggml.eos_token_id")
        if get("ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        return cls(backend, eos_token_id=eos, bos_token_id=bos, chat_template=get("chat_template"))

    @classmethod
    def from_file(cls, tokenizer_json_path: str) -> Tokenizer:
        """Load ``tokenizer.json``; special tokens and chat template come from the sibling
        ``tokenizer_config.json`` (then ``config.json``) when present."""
        backend = BackendTokenizer.from_file(tokenizer_json_path)
        directory = os.path.dirname(os.path.abspath(tokenizer_json_path))
        tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(directory, "config.json"))

        def special_id(name: str) -> int | None:
            token = tok_cfg.get(f"{name}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and backend.token_to_id(token) is not None:
                return backend.token_to_id(token)
            value: Any = model_cfg.get(f"{name}_token_id")  # JSON: an id, a list of ids or null
            return value[0] if isinstance(value, list) and value else value

        template = tok_cfg.get("chat_template")
        if template is None and os.path.exists(os.path.join(directory, "chat_template.jinja")):
            with open(os.path.join(directory, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        return cls(
            backend, eos_token_id=special_id("eos"), bos_token_id=special_id("bos"), chat_template=template
        )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """A sandboxed Jinja environment with the helpers HF chat templates call."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
