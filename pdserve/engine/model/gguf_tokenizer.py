"""A GGUF file's tokenizer, rebuilt from its metadata to give llama.cpp's token ids.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the
token types and scores, the merges of a byte-level BPE, the name of llama.cpp's pre-tokenizer
(``tokenizer.ggml.pre``) and a few flags. What those mean is what llama.cpp (``llama-vocab.cpp``)
does with them, so that is the reference: ``tests/data/tokenizers`` holds ``llama-tokenize``'s ids
for a fixed multilingual text set, and the tests hold these tokenizers to them id for id.

Two kinds are built, each from ``tokenizers``' own components (its Rust BPE does the work):

* ``"gpt2"``, byte-level BPE (SmolLM, Llama 3, Qwen 2.5/3, Mistral's tekken): the file's merges,
  split first by the regexes llama.cpp uses for that pre-tokenizer name (applied one after the
  other, each splitting the pieces of the last, as llama.cpp's ``unicode_regex_split`` does),
  ``ignore_merges`` where llama.cpp sets it (a piece that is itself a token is that token).
* ``"llama"``, SentencePiece BPE (Gemma, Llama 2, Mistral v0.1-0.3): llama.cpp merges the
  adjacent pair whose merged text is the best-scored token, leftmost first, and spells what is
  left with byte tokens (``<0x41>``). That is a BPE whose merges are every split of every token
  into two tokens, ranked by the merged token's score, with byte fallback; spaces are written as
  ``▁`` and, with ``add_space_prefix``, a ``▁`` goes before every text run (at the start and after
  each special token: llama.cpp prefixes a space whenever the previous piece was a token).

Tokens typed control, user-defined or unknown are matched whole in the text before anything else,
as llama.cpp's ``tokenizer_st_partition`` does with special tokens parsed (its server's and
``llama-tokenize``'s default), and control tokens are skipped when decoding with
``skip_special_tokens``.

Why not transformers' GGUF converters (``transformers.integrations.gguf``, 5.23): they aim at the
model's original ``tokenizer.json``, not at llama.cpp, and on the recorded text set they differ
from llama.cpp for "smollm"/"starcoder" (no entry: GPT-2 splitting, so ``"x  1"`` groups its
spaces differently; 1 text of 38), "default"/"falcon" (no regex chain: 11 of 38), and a
SentencePiece file with ``add_space_prefix`` (``Metaspace`` prepends "first" only, llama.cpp
after every special token too, and leading spaces differ: 6 of 38). Where they agree (Gemma 3,
the Llama 3 / Qwen / tekken / gpt-4o names) they are no faster: Gemma's 262k-token vocabulary
takes them 3.5 s plus 1.2 s to import transformers, this 1.6 s. The regex strings below are
llama.cpp's own (its ``(?:'[sS]|...)`` spelling of ``(?i:'s|...)``, which ``tokenizers``' regex
engine would otherwise case-fold more widely).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


class UnsupportedTokenizerError(ValueError):
    """The file's tokenizer cannot be built here; the message is one line naming what can."""


# llama.cpp's token types (llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- byte-level BPE pre-tokenizers: llama.cpp's regexes (llm_tokenizer_bpe) -----------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's spelling of \p{Lu}-ish / \p{Ll}-ish (its regex engine has no such classes).
_UPPERISH, _LOWERISH = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class BpePre:
    """What llama.cpp does for one family of ``tokenizer.ggml.pre`` names."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_LLAMA3_PRE = BpePre((_LLAMA3,), ignore_merges=True, add_bos=True)
_STARCODER_PRE = BpePre((r"\p{N}", _GPT2))
_GPT2_PRE = BpePre((_GPT2,))
_QWEN2_PRE = BpePre((_QWEN2,))

# tokenizer.ggml.pre -> its family, as llama.cpp's llama_vocab::impl::load maps the names (only
# the families whose regexes are written here; llama.cpp refuses a name it does not know too).
BPE_PRE_TOKENIZERS: dict[str, BpePre] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], BpePre((_LLAMA3,))),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"],
        _QWEN2_PRE,
    ),
    "qwen35": BpePre((_QWEN35,)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _STARCODER_PRE,
    ),
    **dict.fromkeys(
        ["gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "exaone4", "trillion"],
        _GPT2_PRE,
    ),
    "granite-docling": _GPT2_PRE,
    "default": BpePre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "falcon": BpePre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "tekken": BpePre((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], BpePre((_GPT4O,))),
}

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece


def bpe_pre(pre: str | None) -> BpePre:
    """The family of a ``tokenizer.ggml.pre`` name; llama.cpp reads a missing one as "default"."""
    family = BPE_PRE_TOKENIZERS.get(pre or "default")
    if family is None:
        raise UnsupportedTokenizerError(
            f"unsupported tokenizer.ggml.pre {pre!r} (byte-level BPE); supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
        )
    return family


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == pre``."""
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in bpe_pre(pre).regexes
    ]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


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


# ---- the builders ---------------------------------------------------------------------------


@dataclass
class GgufTokenizer:
    """A built backend and what llama.cpp reads beside it."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    add_eos: bool


Get = Callable[[str, Any], Any]  # tokenizer.<key> of the file, or a default


def check_gguf_tokenizer(get: Get) -> None:
    """Raise ``UnsupportedTokenizerError`` (one line) unless ``build_gguf_tokenizer`` can build
    this tokenizer: a cheap look at the metadata, before any weight is read."""
    kind = get("ggml.model", None)
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedTokenizerError(
            f"unsupported tokenizer.ggml.model {kind!r}; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
        )
    if not get("ggml.tokens", None):
        raise UnsupportedTokenizerError("the GGUF file has no tokenizer.ggml.tokens")
    if kind == "gpt2":
        bpe_pre(get("ggml.pre", None))
    elif get("ggml.scores", None) is None:
        raise UnsupportedTokenizerError(
            "a SentencePiece ('llama') GGUF tokenizer needs tokenizer.ggml.scores"
        )


def build_gguf_tokenizer(get: Get) -> GgufTokenizer:
    """Build the tokenizer ``tokenizer.*`` metadata describes (``get("ggml.model", None)``...).

    Raises ``UnsupportedTokenizerError`` (one line) for a kind or pre-tokenizer not built here.
    """
    check_gguf_tokenizer(get)
    kind = get("ggml.model", None)
    tokens: list[str] = get("ggml.tokens", None)
    types: list[int] = list(get("ggml.token_type", None) or [NORMAL] * len(tokens))
    if kind == "gpt2":
        pre = bpe_pre(get("ggml.pre", None))
        backend = _byte_level_bpe(tokens, types, get("ggml.merges", None) or [], get("ggml.pre", None), pre)
        bos_default, eos_default, add_bos_default = None, None, pre.add_bos
    else:
        # llama.cpp's SentencePiece defaults: <unk> <s> </s> = 0 1 2, a space prefix, BOS added.
        unk = get("ggml.unknown_token_id", 0)
        backend = _sentencepiece_bpe(
            tokens, types, get("ggml.scores", None), unk if unk is not None and unk < len(tokens) else None,
            bool(get("ggml.add_space_prefix", True)),
        )  # fmt: skip
        bos_default, eos_default, add_bos_default = 1, 2, True
    _add_special_tokens(backend, tokens, types)
    bos = get("ggml.bos_token_id", bos_default)
    eos = get("ggml.eos_token_id", eos_default)
    add_bos = bool(get("ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(get("ggml.add_eos_token", False)) and eos is not None
    backend.post_processor = _bos_eos_processor(tokens, bos if add_bos else None, eos if add_eos else None)
    return GgufTokenizer(backend, bos, eos, add_bos, add_eos)


def _byte_level_bpe(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre_name: str | None, pre: BpePre
) -> BackendTokenizer:
    spelled = frozenset(byte_alphabet().values())
    alphabet = byte_alphabet()

    def spell(token: str, kind: int) -> str:
        # Vocabulary entries are byte-level spelled; a control or user-defined token is stored as
        # its raw text (llama.cpp matches it in the raw text), and kept so, to be added whole.
        if kind in (CONTROL, USER_DEFINED, UNKNOWN) or set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spell(token, kind): i for i, (token, kind) in enumerate(zip(tokens, types, strict=True))}
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre_name)
    backend.decoder = decoders.ByteLevel()
    return backend


SPIECE_SPACE = "\u2581"  # ▁


def _sentencepiece_bpe(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float],
    unk: int | None,
    add_space_prefix: bool,
) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, scores),
            unk_token=tokens[unk] if unk is not None else None,
            byte_fallback=True,
            fuse_unk=False,
        )
    )
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_SPACE)])
    backend.pre_tokenizer = None  # llama.cpp merges over the whole run of text
    # The pieces' text as it is (no stripping of the prefix space: the router decodes generated
    # tokens alone, and " Paris" after a prompt must keep its space).
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scored merged token first.

    llama.cpp merges the adjacent pair whose concatenation is the best-scored token (the leftmost
    among equals); a BPE ranking each pair by its merged token's score does the same, since pairs
    making one token never overlap and a vocabulary's normal tokens have distinct scores.
    """
    index = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    append = merges.append
    for i in sorted(range(len(tokens)), key=lambda i: -float(scores[i])):  # stable: file order on ties
        token = tokens[i]
        if len(token) < 2 or index[token] != i:  # a duplicate: llama.cpp keeps the last
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                append((left, right))
    return merges


def _add_special_tokens(backend: BackendTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    # Control and unknown tokens: matched whole, skipped on decode; user-defined ones matched
    # whole and kept on decode (llama.cpp prints them).
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=True)
            if kind in (CONTROL, UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED
        ]
    )


def _bos_eos_processor(
    tokens: Sequence[str], bos: int | None, eos: int | None
) -> processors.PostProcessor | None:
    if bos is None and eos is None:
        return None
    head = [tokens[bos]] if bos is not None else []
    tail = [tokens[eos]] if eos is not None else []
    special = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B", *tail], special_tokens=special
    )
