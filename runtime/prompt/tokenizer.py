"""Tokenizer and chat template: built from GGUF metadata or a Hugging Face tokenizer.json.

Owns text <-> token ids (byte-level BPE, and Gemma's SentencePiece BPE with byte fallback, through the
``tokenizers`` library), the special tokens, end-of-sequence ids and rendering the model's own Jinja chat
template.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer split patterns by the GGUF ``tokenizer.ggml.pre`` name (as llama.cpp defines them).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class TokenizerError(ValueError):
    """The tokenizer described by the checkpoint cannot be built."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt2", "default", "gpt-2", ""):
        return byte_level_regex
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"), byte_level_plain]
        )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"), byte_level_plain]
        )
    raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: gpt2, smollm, llama-bpe, qwen2)")


def bpe_from_gguf(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str
) -> HFTokenizer:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` arrays."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == TOKEN_TYPE_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def gemma_spm_from_gguf(tokens: Sequence[str], token_types: Sequence[int], unk_token: str) -> HFTokenizer:
    """Build Gemma's SentencePiece tokenizer (GGUF ``tokenizer.ggml.model = llama``) as a ``tokenizers`` BPE.

    Reproduces transformers' GGUF converter for Gemma (``gemma_tokenizer`` + ``GemmaTokenizer``): spaces
    become "\u2581" (no prefix space; the pre-tokenizer's split on " " then finds none, as in transformers,
    so BPE sees whole texts between added tokens), unknown bytes fall back to the ``<0xNN>`` tokens,
    decoding maps "\u2581" back to spaces and fuses bytes. The file has no merges
    (and flat scores), so they are rebuilt from the vocabulary: every split of a token into two tokens,
    ranked by the token's position in the file, longer left part first. Tokens of only spaces are
    stored with real spaces and renamed to "\u2581" runs first, so that they take part in merges.
    """
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(respelled)}
    merges: list[tuple[str, str]] = []
    for tok in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(tok) - 1, 0, -1):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL
    ])
    # user-defined tokens ("\n", "<start_of_image>") are matched whole, as llama.cpp does; the space runs
    # are not (their spelling is no longer in the vocabulary), they come from merges
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED and tokens[i] in vocab
    ]
    if user:
        tok.add_tokens(user)
    return tok


def end_of_turn_ids(tokenizer: HFTokenizer, chat_template: str | None) -> list[int]:
    """Gemma's chat turns end with ``<end_of_turn>``, not EOS: a stop id when the chat template writes it."""
    eot = tokenizer.token_to_id("<end_of_turn>")
    return [eot] if chat_template and eot is not None and "<end_of_turn>" in chat_template else []


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict[str, object], ...] = ()  # an assistant's calls ({"id", "type", "function"}), for templates
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict[str, object]:
        """The message as chat templates read it (the tool fields only where set)."""
        out: dict[str, object] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Tokenizer:
    """Encode/decode plus the chat template of one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        # the same tokenizer with special-token parsing off: user text that spells a special token
        # (``<|im_start|>``) is encoded as the characters it is, never as the control token
        self._plain = HFTokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._specials = tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    def spec(self) -> dict[str, object]:
        """Everything needed to rebuild this tokenizer elsewhere (``from_spec``): the router tokenizes
        prompts exactly as the replica it learned this from."""
        return {"tokenizer": self._tok.to_str(), "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id, "add_bos": self.add_bos, "chat_template": self.chat_template}

    @classmethod
    def from_spec(cls, spec: dict[str, object]) -> Tokenizer:
        try:
            backend = HFTokenizer.from_str(str(spec["tokenizer"]))
            eos = [int(t) for t in spec["eos_token_ids"]]  # type: ignore[attr-defined]
            bos = spec["bos_token_id"]
            template = spec["chat_template"]
            return cls(backend, eos, None if bos is None else int(bos),  # type: ignore[call-overload]
                       bool(spec["add_bos"]), None if template is None else str(template))
        except Exception as exc:
            raise TokenizerError(f"not a tokenizer spec: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special=False`` encodes special-token spellings as plain text."""
        _check_text(text)
        ids = (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself (otherwise a generic prompt describes them)."""
        return bool(self.chat_template) and "tools" in (self.chat_template or "")

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, object]] | None = None) -> str:
        """Render messages with the model's own Jinja chat template (``tools``: given to it, as transformers
        does, for a template that renders them)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template; use a plain completion prompt")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        extra = {"tools": list(tools)} if tools else {}
        return self._template.render(
            messages=[m.template_dict() for m in messages],
            add_generation_prompt=add_generation_prompt, **extra,
            bos_token=bos or "",
            eos_token=eos or "",
        )

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, object]] | None = None) -> list[int]:
        """The template's own text (its control tokens) with special tokens parsed; each message's content
        as plain text, so that no message can forge a turn. The template writes BOS where the model wants
        one. A conversation with no special-token spelling in any content is encoded in one piece (exactly
        as before); otherwise the contents are found in the rendering through private-use placeholders and
        encoded apart (a template that leaves a content out leaves it out)."""
        for m in messages:
            _check_text(m.content)
        if not any(sp in m.content for m in messages for sp in self._specials):
            return self.encode(self.render_chat(messages, tools=tools), add_bos=False)
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        rendered = self.render_chat([ChatMessage(m.role, mark, m.tool_calls, m.tool_call_id)
                                     for m, mark in zip(messages, marks, strict=True)], tools=tools)
        ids: list[int] = []
        pos = 0
        for message, mark in zip(messages, marks, strict=True):
            at = rendered.find(mark, pos)
            if at < 0:
                continue  # the template left this message out
            ids += self.encode(rendered[pos:at], add_bos=False)
            ids += self.encode(message.content, add_bos=False, special=False)
            pos = at + len(mark)
        return ids + self.encode(rendered[pos:], add_bos=False)


def _check_text(text: str) -> None:
    """Text the tokenizer can take: valid Unicode (a lone UTF-16 surrogate, which JSON can spell as
    ``"\\udfff"``, is not)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"text holds an unpaired UTF-16 surrogate {text[exc.start]!r} at character "
                                 f"{exc.start}; send valid Unicode") from None


def _raise_template_error(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")
