"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

Clients that must count or align tokens exactly as the server does use them: lm-evaluation-harness's
``local-completions`` finds them by itself (its ``remote`` tokenizer) and then needs no copy of the model's
tokenizer. They sit outside ``/v1`` as in vLLM, and need the API key like ``/v1`` (``gate.py``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from pydantic import BaseModel, Field, Strict

from kvdrive.runtime.prompt import ChatMessage
from kvdrive.runtime.prompt.tokenizer import TokenizerError
from kvdrive.runtime.protocol.fields import REQUEST
from kvdrive.runtime.protocol.request_schemas import ChatMessageIn
from kvdrive.runtime.server.errors import ERRORS, ApiError
from kvdrive.runtime.server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = REQUEST
    model: str | None = None
    prompt: str | None = Field(default=None, description="text to encode (or give messages)")
    messages: list[ChatMessageIn] | None = Field(default=None, description="a conversation, through the chat template")
    add_special_tokens: Annotated[bool, Strict()] = Field(default=True, description="BOS as the model wants one")
    return_token_strs: Annotated[bool, Strict()] = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = REQUEST
    model: str | None = None
    tokens: list[Annotated[int, Strict()]]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None = None
    add_bos_token: bool
    vocab_size: int
    model_max_length: int
    chat_template: str | None


def tokenize_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    tok = state.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None and name not in (state.config.model_id, *state.config.aliases):
            raise ApiError(404, f"model {name!r} is not served here (served: {state.config.model_id})",
                           "not_found_error", "model")

    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        try:
            if body.messages is not None:
                ids = tok.encode_chat([ChatMessage(m.role, m.text()) for m in body.messages])
            else:
                ids = tok.encode(body.prompt or "", add_bos=None if body.add_special_tokens else False)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="prompt" if body.messages is None else "messages") from exc
        strs = [tok.token_text(t) or "" for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_context, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise ApiError(400, f"tokens: ids must be in [0, {tok.vocab_size}); got {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False))

    @router.get("/tokenizer_info", response_model=TokenizerInfo, responses={401: ERRORS[401]})
    async def tokenizer_info() -> TokenizerInfo:
        eos = tok.token_text(tok.eos_token_ids[0]) if tok.eos_token_ids else None
        bos = tok.token_text(tok.bos_token_id) if tok.bos_token_id is not None else None
        return TokenizerInfo(eos_token=eos, bos_token=bos, add_bos_token=tok.add_bos, vocab_size=tok.vocab_size,
                             model_max_length=state.max_context, chat_template=tok.chat_template)

    return router
