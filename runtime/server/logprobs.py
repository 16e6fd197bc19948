"""Generated tokens' log-probabilities in the two shapes OpenAI answers with.

A token's text is its own decoding (special tokens spelled out) and ``bytes`` (chat) the UTF-8 of that text; a
token holding only part of a character decodes to U+FFFD, whose bytes are then given (not the token's raw
bytes, as OpenAI gives). Completions give ``text_offset``: where each token's text starts in the answer (counted from the
echoed prompt, when there is one).
"""

from __future__ import annotations

from kvdrive.runtime.engine.sampling import TokenLogprob
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.server import schemas as s


class LogprobRenderer:
    """Renders one request's token log-probabilities, chunk by chunk (a completion's offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, offset: int = 0) -> None:
        """``offset``: where the answer's first token starts in the completion's text (after an echo)."""
        self.tokenizer, self.chat, self.offset = tokenizer, chat, offset
        self._texts: dict[int, str] = {}

    def _text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _top(self, token: int, logprob: float) -> s.TopLogprob:
        text = self._text(token)
        return s.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def chat_body(self, lps: tuple[TokenLogprob, ...]) -> s.ChatLogprobs:
        return s.ChatLogprobs(content=[
            s.ChatTokenLogprob(**self._top(lp.token, lp.logprob).model_dump(),
                               top_logprobs=[self._top(t, v) for t, v in lp.top]) for lp in lps])

    def completion_body(self, lps: tuple[TokenLogprob, ...]) -> s.CompletionLogprobs:
        tokens, offsets = [], []
        for lp in lps:
            text = self._text(lp.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return s.CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in lps],
                                    top_logprobs=[self._by_text(lp) for lp in lps], text_offset=offsets)

    def _by_text(self, lp: TokenLogprob) -> dict[str, float]:
        """A completion's alternatives, keyed by their text: two tokens with the same text (e.g. two parts of
        characters, both U+FFFD) keep the likelier's value."""
        out: dict[str, float] = {}
        for t, v in lp.top:
            out.setdefault(self._text(t), v)
        return out

    def body(self, lps: tuple[TokenLogprob, ...]) -> s.ChatLogprobs | s.CompletionLogprobs:
        return self.chat_body(lps) if self.chat else self.completion_body(lps)
