"""Incremental detokenization with stop strings: turns a token stream into text deltas."""

from __future__ import annotations

from collections.abc import Sequence

from kvdrive.runtime.prompt import Tokenizer


class TextStream:
    """Feeds token ids, returns the new text each time; stops at a stop string (excluded)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        for s in self.stop:
            cut = full.find(s)
            if cut != -1:
                self.stopped = True
                full = full[:cut]
                break
        # hold back a tail that could still become a stop string
        hold = 0 if self.stopped else max((_overlap(full, s) for s in self.stop), default=0)
        ready = full[: len(full) - hold]
        delta = ready[len(self.text) :]
        self.text = ready if len(ready) > len(self.text) else self.text
        return delta

    def flush(self) -> str:
        full = self.tokenizer.decode(self.ids)
        if self.stopped:
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
