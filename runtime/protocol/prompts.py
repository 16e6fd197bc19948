"""A request's prompt as token ids: what the runtime computes, and what the router computes to find the
replica that holds its pages (the same function, so both see the same tokens)."""

from __future__ import annotations

from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.protocol import request_schemas as r
from kvdrive.runtime.protocol.tool_prompt import messages


def completion_prompts(body: r.CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Each prompt's token ids: given as such, or the text encoded (BOS as the model wants). Raises
    TokenizerError."""
    return [list(p) if isinstance(p, list) else tokenizer.encode(p) for p in body.prompts()]


def completion_prompt(body: r.CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The first prompt's token ids: what a router places a batch by. Raises TokenizerError."""
    first = body.prompts()[0]
    return list(first) if isinstance(first, list) else tokenizer.encode(first)


def chat_prompt(body: r.ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The conversation through the model's chat template, with its tools (``tool_prompt.py``). Raises
    TokenizerError."""
    msgs, tools = messages(body, tokenizer.template_has_tools)
    return tokenizer.encode_chat(msgs, tools=tools)
