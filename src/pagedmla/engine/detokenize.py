"""Text of a completion as its tokens arrive, and stop strings.

A token need not decode to whole characters on its own (a byte-level tokenizer splits
a UTF-8 character over several tokens; SentencePiece-style tokenizers drop a leading
space when a token is decoded alone), so the text is never the concatenation of the
tokens' own decodings. `IncrementalDetokenizer` decodes a short window of recent tokens
instead: the text the newest tokens add is the window's decoding minus what the same
window decoded to without them, and it is held back while it ends in an incomplete
character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedmla.tokenizer import TextTokenizer

# Tokens of context decoded before the new ones, so that the tokenizer sees each new
# token where it stands in the text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """The text of a growing list of token ids, a piece at a time.

    `add(ids)` takes the newly generated ids and returns the text they complete (empty
    while a character is incomplete); `text` is everything returned so far.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window starts here
        self._read = 0  # ids before this are in `text`

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        window = self.tokenizer.decode(self.ids[self._prefix:self._read])
        extended = self.tokenizer.decode(self.ids[self._prefix:])
        if len(extended) <= len(window) or extended.endswith("\ufffd"):
            return ""
        piece = extended[len(window):]
        self.text += piece
        self._read = len(self.ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        return piece

    def flush(self) -> str:
        """At the end of the completion: the text held back (an incomplete character
        decodes to U+FFFD now)."""
        if self._read == len(self.ids):
            return ""
        window = self.tokenizer.decode(self.ids[self._prefix:self._read])
        piece = self.tokenizer.decode(self.ids[self._prefix:])[len(window):]
        self.text += piece
        self._read = len(self.ids)
        return piece


def find_stop(text: str, stops: Sequence[str], searched: int) -> int:
    """The index in `text` where the earliest of `stops` begins, looking only at matches
    that end past text[:searched] (those inside it were looked for before); -1 if none.

    searched: the length of the text at the previous call (0 the first time)."""
    found = -1
    for stop in stops:
        at = text.find(stop, max(0, searched - len(stop) + 1))
        if at != -1 and (found == -1 or at < found):
            found = at
    return found
