"""The phased workload of the tuning benchmark: closed-loop streaming clients against one ``kvdrive serve``.

Owns what the clients send and what they measure. Phase ``long``: ``long_streams`` clients, each asking
question after question about its own ~``long_tokens``-token document (its pages are reused from the
tiers after the first request). Phase ``short``: ``short_clients`` clients sending short distinct
prompts. Every request streams; a client records its time to first token and the tokens it received.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("river", "market", "stone", "bridge", "harbor", "tower", "garden", "winter", "engine", "letter", "forest",
         "signal", "copper", "valley", "lantern", "orbit", "meadow", "archive", "pillar", "canvas")


def document(index: int, words: int) -> str:
    rng = random.Random(1000 + index)
    body = " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))
    return f"Document {index}.\n{body}\n"


@dataclass
class PhaseLog:
    """What the clients saw in one phase."""

    name: str
    ttft: list[float] = field(default_factory=list)  # seconds, per request that produced a token
    tokens: int = 0  # streamed tokens received
    requests: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Workload:
    long_streams: int = 2
    long_words: int = 2060  # ~6K tokens of the demo tokenizer (2,912 tokens per 1,000 words)
    long_max_tokens: int = 96
    short_clients: int = 16
    short_words: int = 24
    short_max_tokens: int = 32

    async def run(self, url: str, phase: str, seconds: float, log: PhaseLog) -> None:
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
            if phase == "long":
                await asyncio.gather(*(self._client(client, i, deadline, log, long=True)
                                       for i in range(self.long_streams)))
            else:
                await asyncio.gather(*(self._client(client, i, deadline, log, long=False)
                                       for i in range(self.short_clients)))

    def long_prompt(self, index: int, question: int, doc: str | None = None) -> str:
        """A question about long document ``index`` (the document is the shared prefix)."""
        doc = doc if doc is not None else document(index, self.long_words)
        return f"{doc}Question {question}: what follows {WORDS[question % len(WORDS)]}{question % 100}?"

    async def _client(self, client: httpx.AsyncClient, index: int, deadline: float, log: PhaseLog,
                      long: bool) -> None:
        rng = random.Random(index * 7919 + (1 if long else 2))
        serial = 0
        doc = document(index, self.long_words) if long else ""
        while time.monotonic() < deadline:
            serial += 1
            if long:
                prompt = self.long_prompt(index, rng.randrange(10**6), doc)
                max_tokens = self.long_max_tokens
            else:
                words = " ".join(rng.choice(WORDS) for _ in range(self.short_words))
                prompt = f"Note {index}-{serial}-{rng.randrange(10**6)}: {words}. Summary:"
                max_tokens = self.short_max_tokens
            await self.request(client, prompt, max_tokens, log)

    @staticmethod
    async def request(client: httpx.AsyncClient, prompt: str, max_tokens: int, log: PhaseLog) -> None:
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        started, first, got = time.monotonic(), None, 0
        try:
            async with client.stream("POST", "/v1/completions", json=body) as rsp:
                if rsp.status_code != 200:
                    await rsp.aread()
                    log.errors += 1
                    await asyncio.sleep(0.5)
                    return
                async for line in rsp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if json.loads(line[6:])["choices"][0]["text"] is not None:
                        got += 1
                        if first is None:
                            first = time.monotonic() - started
        except httpx.HTTPError:
            log.errors += 1
            return
        log.requests += 1
        log.tokens += got
        if first is not None:
            log.ttft.append(first)
