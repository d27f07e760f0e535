"""Streaming text from token ids: each step's new tokens become the text they add.

Byte-level BPE splits multi-byte characters across tokens, so decoding only the new
tokens can yield half a character (U+FFFD). The decoder re-decodes the whole output and
emits what grew past the text already sent, holding back a trailing U+FFFD until the
next token completes it; `flush` releases whatever is left at the end. Concatenating
every delta therefore equals decoding all tokens at once.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """The text `ids` add (possibly empty while a character is incomplete)."""
        self.ids += ids
        text = self.text
        end = len(text) - 1 if text.endswith(REPLACEMENT) else len(text)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def flush(self) -> str:
        """Everything not yet emitted (at the end of a request)."""
        text = self.text
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
