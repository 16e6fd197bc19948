"""The routing benchmark's workload and clients: shared documents asked about with different questions,
and unique prompts, sent by concurrent streaming clients, with the same sequence in every run.

Each client draws from its own seeded generator, so two runs (two routing policies) send the same
requests in the same order per client. A request is a chat completion streamed back; its time to first
token is the time to the first chunk with text.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvdrive.runtime.bench.texts import haystack_words

QUESTIONS = ("What is the main topic?", "Which places are mentioned?", "Summarize it in one sentence.",
             "What happens in winter?", "Who trades at the bridge?", "What does the market sell?",
             "Is there a lighthouse?", "What is the weather like?", "Name one building.", "What do bees do?")


@dataclass(frozen=True)
class Workload:
    documents: int = 12
    doc_sentences: tuple[int, int] = (125, 250)  # ~12 tokens a sentence: 1.5K-3K tokens
    shared_share: float = 0.7
    unique_sentences: tuple[int, int] = (8, 24)
    max_tokens: int = 16
    seed: int = 0

    def document(self, i: int) -> str:
        rng = random.Random(self.seed * 1000 + i)
        return haystack_words(rng, rng.randint(*self.doc_sentences))

    def request(self, rng: random.Random, serial: str) -> tuple[str, str]:
        """(kind, user message): a shared document with a question, or a unique prompt."""
        if rng.random() < self.shared_share:
            doc = rng.randrange(self.documents)
            return "shared", (f"Here is document {doc}.\n\n{self.document(doc)}\n\n"
                              f"Question ({serial}): {rng.choice(QUESTIONS)}")
        return "unique", f"Note {serial}: {haystack_words(rng, rng.randint(*self.unique_sentences))}\n\n" \
                         f"{rng.choice(QUESTIONS)}"


@dataclass
class Sample:
    kind: str
    start: float  # seconds since the run began
    ttft: float | None
    tokens: int
    end: float = 0.0  # seconds since the run began
    error: str | None = None
    request: str = ""  # "c{client}-{n}": the same key names the same prompt in every run
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: served from stored pages


@dataclass(frozen=True)
class Answer:
    ttft: float | None
    tokens: int
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None


async def _one(http: httpx.AsyncClient, url: str, model: str, message: str, max_tokens: int,
               headers: dict[str, str]) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, {}
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return Answer(None, 0, f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Answer(ttft, int(usage.get("completion_tokens", 0)), None, int(usage.get("prompt_tokens", 0)),
                      None if cached is None else int(cached))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Answer(ttft, int(usage.get("completion_tokens", 0)), f"{type(exc).__name__}: {exc}")


async def run_clients(url: str, model: str, workload: Workload, clients: int, seconds: float,
                      headers: dict[str, str], tick: Callable[[int], None] = lambda n: None) -> list[Sample]:
    began = time.perf_counter()
    out: list[Sample] = []

    async def client(c: int) -> None:
        rng = random.Random(workload.seed * 7919 + c)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5)) as http:
            n = 0
            while time.perf_counter() - began < seconds:
                key = f"c{c}-{n}"
                kind, message = workload.request(rng, key)
                start = time.perf_counter() - began
                a = await _one(http, url, model, message, workload.max_tokens, headers)
                out.append(Sample(kind, start, a.ttft, a.tokens, time.perf_counter() - began, a.error, key,
                                  a.prompt_tokens, a.cached_tokens))
                tick(len(out))
                n += 1
                if a.error:
                    await asyncio.sleep(0.5)  # as a client would back off

    await asyncio.gather(*(client(c) for c in range(clients)))
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    if len(values) == 1:
        return {"p50": values[0] * 1000, "p90": values[0] * 1000, "p99": values[0] * 1000}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": 1000 * q[49], "p90": 1000 * q[89], "p99": 1000 * q[98]}
