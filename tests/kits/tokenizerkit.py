"""A tokenizer for the tiny random test models: byte-level BPE with no merges, written as tokenizer.json.

Its own module (not conftest): conftest modules of different test folders share the name ``conftest``,
so importing from one by name finds whichever the session loaded first."""

from __future__ import annotations

from pathlib import Path


def byte_level_tokenizer_json(path: Path, extra_special: tuple[str, ...] = ("<s>", "</s>")) -> int:
    """A real byte-level BPE tokenizer with no merges (256 byte tokens + specials). Returns vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in extra_special])
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()
