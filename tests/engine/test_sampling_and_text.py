"""Sampling rules and incremental detokenization with stop strings."""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.engine import SamplingParams, TextStream
from kvdrive.runtime.engine.sampling import make_rng, sample
from kvdrive.runtime.sizes import parse_size


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(), None) == 1
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=5.0, top_p=0.01, seed=1)):
        assert sample(logits, params, make_rng(params)) == 1


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_vanishing_temperature_is_greedy_not_nan(temperature: float) -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    params = SamplingParams(temperature=temperature, seed=1)
    assert sample(logits, params, make_rng(params)) == 1


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_vanishing_temperature_over_masked_negative_logits_is_greedy_among_the_allowed(temperature: float) -> None:
    """A grammar leaves only negative logits (the rest -inf): divided by a vanishing temperature every score is
    -inf, and softmax of all -inf is nan. The limit is the best allowed token."""
    logits = torch.tensor([float("-inf"), -2.0, -0.5, float("-inf"), -3.0])
    params = SamplingParams(temperature=temperature, seed=1)
    assert sample(logits, params, make_rng(params)) == 2


def test_top_k_never_leaves_the_top_k() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0])
    params = SamplingParams(temperature=10.0, top_k=2, seed=0)
    g = make_rng(params)
    assert {sample(logits, params, g) for _ in range(200)} == {0, 1}


def test_seed_reproduces() -> None:
    logits = torch.randn(100)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, p, g) for g in [make_rng(p)] for _ in range(20)]
    b = [sample(logits, p, g) for g in [make_rng(p)] for _ in range(20)]
    other = SamplingParams(temperature=1.0, seed=43)
    c = [sample(logits, other, g) for g in [make_rng(other)] for _ in range(20)]
    assert a == b and a != c


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_invalid_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


class _CharTokenizer:
    """Each token id is one character (ord), like a byte-level tokenizer on ASCII."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        return "".join(chr(i) for i in ids)


def test_stop_string_is_cut_and_partial_matches_are_held_back() -> None:
    stream = TextStream(_CharTokenizer(), stop=["END"])  # type: ignore[arg-type]
    out = [stream.push(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" could start "END": held back
    assert stream.push(ord("D")) == "" and stream.stopped
    assert stream.text == "abc"


def test_held_back_text_is_released_when_no_stop_follows() -> None:
    stream = TextStream(_CharTokenizer(), stop=["END"])  # type: ignore[arg-type]
    text = "".join(stream.push(ord(c)) for c in "xENy") + stream.flush()
    assert text == "xENy" and not stream.stopped


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("4GiB", 4 << 30), ("64Mi", 64 << 20),
                                         ("1G", 10**9), ("1234", 1234), ("1.5KiB", 1536)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12XB", "-1", "MiB", "1..5G"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)

