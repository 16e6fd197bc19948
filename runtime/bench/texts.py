"""Workload text for the benchmarks: varied English filler ("haystack") and passkey prompts.

Deterministic from a seed, so every mode of a benchmark sees exactly the same tokens.
"""

from __future__ import annotations

import random

_SENTENCES = (
    "The grass is green and the sky is blue.",
    "The sun rises in the east and sets in the west.",
    "A river winds through the valley, past old mills and quiet farms.",
    "Traders met at the bridge to exchange grain, salt and cloth.",
    "In winter the lake freezes and children skate on the ice.",
    "The library keeps maps of the region drawn three hundred years ago.",
    "Bees visit the orchard every spring when the apple trees bloom.",
    "The train to the coast leaves at seven and arrives before noon.",
    "Fishermen mend their nets on the harbour wall in the evening.",
    "The old clock in the square has not been wound for many years.",
    "A narrow path climbs the hill to a chapel with a copper roof.",
    "Merchants built tall houses with painted shutters along the canal.",
    "The market sells cheese, bread, honey and fresh vegetables.",
    "Clouds gathered over the mountains and the wind turned cold.",
    "The museum shows tools, coins and pottery found in the fields.",
    "At night the lighthouse sweeps its beam across the dark water.",
)


def haystack_words(rng: random.Random, sentences: int) -> str:
    return " ".join(rng.choice(_SENTENCES) for _ in range(sentences))


def filler_tokens(tokenizer, n: int, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    """About ``n`` tokens of filler text (exactly n, cut at the end)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(haystack_words(rng, 64) + " ")
    return ids[:n]


def passkey_prompt(tokenizer, context: int, depth: float, passkey: int, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    """A completion prompt of about ``context`` tokens hiding ``passkey`` at ``depth`` (0 = start, 1 = end);
    the model is expected to continue with the passkey's digits."""
    intro = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = "\n\nWhat is the pass key? The pass key is"
    overhead = len(tokenizer.encode(intro + needle + question)) + 4
    body = filler_tokens(tokenizer, max(0, context - overhead), seed)
    cut = int(len(body) * depth)
    text = intro + tokenizer.decode(body[:cut]) + needle + tokenizer.decode(body[cut:]) + question
    return tokenizer.encode(text)
