"""Token ids -> text deltas for a streamed request, with stop strings applied.

The router owns text: engines see only token ids. A delta never ends inside a UTF-8 character
(the byte-level tokenizer decodes a partial one as U+FFFD, which is held back until the next
token completes it). With stop strings, the text ends just before the first match (or after it,
with ``include_stop_str_in_output``) and, while streaming, the last ``len(longest stop) - 1``
characters are held back so that a stop string split across tokens never reaches the client
in part — what vLLM's detokenizer does. Tokens are decoded incrementally (tokenizers'
``DecodeStream``, as vLLM's fast detokenizer), so a token costs the same at any output length.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pdserve.engine.model.tokenizer import Tokenizer


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
        self._decoder = DecodeStream(skip_special_tokens=True)
        self.text = ""  # the text of token_ids as decoded so far (all of it once final)
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
            piece = self._decoder.step(self.tokenizer.backend, list(new_ids)) if new_ids else None
            if piece:
                self.text += piece
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
        return self._send(full, end)

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
