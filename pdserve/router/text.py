"""Token ids -> text deltas for a streamed request, with stop strings applied.

The router owns text: engines see only token ids. A delta never ends inside a UTF-8 character
(the byte-level tokenizer decodes a partial one as U+FFFD, which is held back until the next
token completes it). Bytes that can no longer complete a character are not held: a model that
emits a run of byte tokens that are no UTF-8 (SmolLM2 answering random token ids did, ~200 of
them) would otherwise send no text for seconds while its tokens come every few ms. After
``MAX_HELD_TOKENS`` tokens without text, the held tokens' text goes out but for its last three
U+FFFD (a character's first three bytes at most, one U+FFFD each with a byte-fallback decoder):
what a later byte cannot change.

With stop strings, the text ends just before the first match (or after it,
with ``include_stop_str_in_output``) and, while streaming, the last ``len(longest stop) - 1``
characters are held back so that a stop string split across tokens never reaches the client
in part — what vLLM's detokenizer does. Tokens are decoded incrementally (tokenizers'
``DecodeStream``, as vLLM's fast detokenizer; for a byte-level tokenizer, a table of each
token's bytes with the same contract, ``pdserve.engine.model.token_bytes``), so a token costs
the same at any output length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tokenizers.decoders import DecodeStream

from pdserve.engine.model.token_bytes import ByteStream
from pdserve.engine.model.tokenizer import Tokenizer

# Tokens without text after which the held ones' settled text is sent (see the module docstring).
MAX_HELD_TOKENS = 4
REPLACEMENT = "\ufffd"
# Trailing U+FFFD kept back: a character's incomplete first bytes decode to at most 3 of them.
UNSETTLED_REPLACEMENTS = 3


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Characters that may be the start of a stop string and so are not sent yet.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        # A byte-level tokenizer's table of token bytes, or tokenizers' generic DecodeStream.
        table = tokenizer.token_bytes
        self._step: Callable[[list[int]], str | None] = (
            table.stream().step
            if table is not None
            else functools.partial(DecodeStream(skip_special_tokens=True).step, tokenizer.backend)
        )
        self.text = ""  # the text of token_ids as decoded so far (all of it once final)
        self._held_from = 0  # token_ids[_held_from:] have given no text from the decoder yet
        self._settled = ""  # of their text, what went out already (the decoder will repeat it)
        self.sent = 0  # characters of the full text already sent
        self.scanned = 0  # stop strings were searched for in full[:scanned]
        self.matched_stop: str | None = None

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """The next delta. After a stop string matched, ``matched_stop`` is set and the request
        is over: later pushes return nothing."""
        if self.matched_stop is not None:
            return ""
        self.token_ids.extend(new_ids)
        if final:
            # The whole text once (a character still incomplete shows as U+FFFD); what was
            # streamed is always its prefix.
            full = self.tokenizer.decode(self.token_ids)
        else:
            # Incremental: only the new tokens are decoded (None while a UTF-8 character is
            # incomplete), not the whole output again at every token.
            piece = self._step(list(new_ids)) if new_ids else None
            if piece:
                self.text += self._unsettled(piece)
                self._held_from, self._settled = len(self.token_ids), ""
            else:
                held = len(self.token_ids) - self._held_from
                # Each look decodes every held token, so a long run is not looked at on every
                # token: every (held / 16)th, but at least every MAX_HELD_TOKENS-th. Looks
                # further apart (every 12th at 200 held tokens) left a client 12 steps without
                # text: 278 ms on two busy cores, past a 250 ms gap SLO (bench peers --scenario
                # long). A run of n tokens costs n / 4 decodes of up to n tokens: ~0.1 s of CPU
                # for 2,048 tokens of invalid bytes (~35 ms before), a few ms for 256.
                every = min(max(1, held // 16), MAX_HELD_TOKENS)
                if held > MAX_HELD_TOKENS and (held - MAX_HELD_TOKENS) % every == 0:
                    self.text += self._settle()
            full = self.text
        end = len(full)
        if self.stop:
            # As in vLLM, stop strings count only once min_tokens tokens were generated.
            match = self._find_stop(full) if len(self.token_ids) >= self.min_tokens else None
            if match is not None:
                position, stop = match
                self.matched_stop = stop
                end = position + len(stop) if self.include_stop else position
                return self._send(full, max(end, self.sent))
            self.scanned = max(0, len(full) - self.holdback)
        if self.stop and not final:
            end = max(self.sent, len(full) - self.holdback)
        delta = full[self.sent : end]  # ``_send``, inline on every token's way
        self.sent = end
        return delta

    def in_step(self) -> bool:
        """True when the next tokens' text is each token's own, as the token relay sends it: no
        stop strings to look for, no token held back for want of text, no partial character."""
        if self.stop or self._held_from != len(self.token_ids):
            return False
        stream = getattr(self._step, "__self__", None)
        return isinstance(stream, ByteStream) and stream.idle()

    def relayed(self, token_ids: list[int], text: str) -> None:
        """Tokens the token relay sent, ``text`` being theirs: as if pushed, one at a time."""
        self.token_ids.extend(token_ids)
        self.text += text
        self.sent = len(self.text)
        self._held_from, self._settled = len(self.token_ids), ""

    def _settle(self) -> str:
        """The held tokens' text that no later byte can change, less what went out before."""
        start = self._held_from
        context = self.token_ids[max(0, start - 4) : start]  # for a leading space, as the decoder
        before = self.tokenizer.decode(context)
        held = self.tokenizer.decode(context + self.token_ids[start:])
        if not held.startswith(before):
            return ""
        text = held[len(before) :]
        keep = len(text) - len(text.rstrip(REPLACEMENT))
        text = text[: len(text) - min(keep, UNSETTLED_REPLACEMENTS)]
        if not text.startswith(self._settled):
            return ""
        new, self._settled = text[len(self._settled) :], text
        return new

    def _unsettled(self, piece: str) -> str:
        """The decoder's piece after a hold, less the settled part already sent."""
        if piece.startswith(self._settled):
            return piece[len(self._settled) :]
        # Not expected (the decoder saw another context): the piece goes as it is.
        return piece

    def _find_stop(self, full: str) -> tuple[int, str] | None:
        # Only text not searched before: a match must end in what this push added.
        start = self.scanned
        best: tuple[int, str] | None = None
        for stop in self.stop:
            position = full.find(stop, start)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _send(self, full: str, end: int) -> str:
        delta = full[self.sent : end]
        self.sent = end
        return delta
