"""Generated tokens' log-probabilities in the two shapes OpenAI answers with.

A token's text is its own decoding (special tokens spelled out) and ``bytes`` (chat) the UTF-8 of that text; a
token holding only part of a character decodes to U+FFFD, whose bytes are then given (not the token's raw
bytes, as OpenAI gives). Completions give ``text_offset``: where each token's text starts in the answer (counted from the
echoed prompt, when there is one). With ``echo`` the prompt's tokens come first, as OpenAI gives them: the
first with a null log-probability (nothing predicts it), the others with theirs (``prompt_logprobs.py``).
A completion that ends with end-of-sequence (or a ``stop_token_ids`` token) lists that token last, as vLLM
does, although its text is not part of the answer; a chat answer's content leaves it out.
"""

from __future__ import annotations

from kvdrive.runtime.engine.sampling import TokenLogprob
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.server import response_schemas as s


class LogprobRenderer:
    """Renders one request's token log-probabilities, chunk by chunk (a completion's offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, echo_first: int | None = None) -> None:
        """``echo_first``: the prompt's first token, when the prompt is echoed with its log-probabilities."""
        self.tokenizer, self.chat, self.echo_first = tokenizer, chat, echo_first
        self.offset = 0  # where the next token's text starts in the completion's text
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
        """The content's tokens (a final end-of-sequence token, not part of the content, is left out)."""
        eos = self.tokenizer.eos_token_ids
        return s.ChatLogprobs(content=[
            s.ChatTokenLogprob(**self._top(lp.token, lp.logprob).model_dump(),
                               top_logprobs=[self._top(t, v) for t, v in lp.top]) for lp in lps if lp.token not in eos])

    def completion_body(self, lps: tuple[TokenLogprob, ...],
                        prompt: tuple[TokenLogprob, ...] | None = None) -> s.CompletionLogprobs:
        """``prompt``: the echoed prompt's tokens 1.. (given once, with the first generated ones)."""
        tokens: list[str] = []
        offsets: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []

        def add(token: int, value: float | None, top: dict[str, float] | None) -> None:
            text = self._text(token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            values.append(value)
            tops.append(top)

        if prompt is not None and self.echo_first is not None:
            add(self.echo_first, None, None)
        for lp in (*(prompt or ()), *lps):
            add(lp.token, lp.logprob, self._by_text(lp))
        return s.CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    def _by_text(self, lp: TokenLogprob) -> dict[str, float]:
        """A completion's alternatives, keyed by their text: two tokens with the same text (e.g. two parts of
        characters, both U+FFFD) keep the likelier's value."""
        out: dict[str, float] = {}
        for t, v in lp.top:
            out.setdefault(self._text(t), v)
        return out

    def body(self, lps: tuple[TokenLogprob, ...],
             prompt: tuple[TokenLogprob, ...] | None = None) -> s.ChatLogprobs | s.CompletionLogprobs:
        return self.chat_body(lps) if self.chat else self.completion_body(lps, prompt)
