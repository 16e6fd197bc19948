"""A request's prompt as token ids: what the runtime computes, and what the router computes to find the
replica that holds its pages (the same function, so both see the same tokens)."""

from __future__ import annotations

from kvdrive.runtime.prompt import ChatMessage, Tokenizer
from kvdrive.runtime.server import schemas as s


def completion_prompt(body: s.CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Token ids given as such, or the text encoded (BOS as the model wants). Raises TokenizerError."""
    return list(body.prompt) if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)


def chat_prompt(body: s.ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The conversation through the model's chat template. Raises TokenizerError."""
    return tokenizer.encode_chat([ChatMessage(m.role, m.text()) for m in body.messages])
