"""Load benchmark against a running server: N concurrent streaming clients for a bounded time.

Measures client-side TTFT and inter-token latency percentiles, counts errors, samples /metrics to
check that no tier exceeds its capacity, and that tier usage returns to its idle baseline. With
``long_clients`` > 0 the load is mixed: that many clients send long documents (about ``long_sentences``
sentences of filler, ~12 tokens each, each prompt distinct so no prefix is reused) among short chat
questions, and latencies are also reported per class ("short", "long").
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from kvdrive.runtime.bench.texts import haystack_words

_PROMPTS = [
    "Explain how a refrigerator works.", "Write a haiku about autumn.", "What is the capital of Japan?",
    "List three uses of copper.", "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
    "Give me a tip for learning to cook.", "Why is the sky blue?",
]
_GAUGE = re.compile(r'^kvdrive_tier_(capacity|used|cached)_bytes\{([^}]*)\} (\S+)$', re.M)


@dataclass(frozen=True)
class ClassResult:
    requests: int  # completed
    errors: int
    tokens: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]


@dataclass(frozen=True)
class LoadResult:
    clients: int
    seconds: float
    requests: int
    errors: int
    tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    max_used_over_capacity: dict[str, float]  # tier -> max((used + cached)/capacity) sampled during the run
    idle_used_before: dict[str, float]
    idle_used_after: dict[str, float]
    classes: dict[str, ClassResult]  # "short" and, with long clients, "long"


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": round(q[49] * 1000, 1), "p90": round(q[89] * 1000, 1), "p99": round(q[98] * 1000, 1)}


def _tiers(text: str, cached: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """(capacity, used) per tier; ``cached``: used counts every held byte (running sequences' pages and
    reusable cached ones), else only ``kvdrive_tier_used_bytes`` (what running sequences hold)."""
    cap: dict[str, float] = {}
    used: dict[str, float] = {}
    for kind, labels, value in _GAUGE.findall(text):
        tier = re.search(r'tier="(\w+)"', labels).group(1)  # type: ignore[union-attr]
        if kind == "capacity":
            cap[tier] = float(value)
        elif kind == "used" or cached:
            used[tier] = used.get(tier, 0.0) + float(value)
    return cap, used


def _content(i: int, n: int, long: bool, sentences: int) -> str:
    if not long:
        return _PROMPTS[(i + n) % len(_PROMPTS)]
    text = haystack_words(random.Random(i * 100_003 + n), sentences)
    return f"Report {i}-{n}. {text}\nWhich places does this report mention?"


async def run_load(url: str, clients: int = 16, seconds: float = 60.0, max_tokens: int = 48,
                   api_key: str | None = None, long_clients: int = 0, long_sentences: int = 170,
                   model: str = "demo") -> LoadResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    names = ("long", "short")
    ttfts: dict[str, list[float]] = {c: [] for c in names}
    itls: dict[str, list[float]] = {c: [] for c in names}
    per: dict[str, dict[str, int]] = {c: {"requests": 0, "errors": 0, "tokens": 0} for c in names}
    ratio: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        _, before = _tiers((await http.get("/metrics")).text, cached=False)
        deadline = time.monotonic() + seconds

        async def client(i: int) -> None:
            n = 0
            kind = "long" if i < long_clients else "short"
            counts, ttft, itl = per[kind], ttfts[kind], itls[kind]
            while time.monotonic() < deadline:
                body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                        "messages": [{"role": "user", "content": _content(i, n, kind == "long", long_sentences)}]}
                n += 1
                start, last, failed = time.perf_counter(), None, False
                try:
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            counts["errors"] += 1
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                failed = True
                                break
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                now = time.perf_counter()
                                (ttft if last is None else itl).append(now - (start if last is None else last))
                                last = now
                                counts["tokens"] += 1
                    counts["errors" if failed else "requests"] += 1
                except httpx.HTTPError:
                    counts["errors"] += 1

        async def sampler() -> None:
            while time.monotonic() < deadline:  # requests still running at the deadline finish, unsampled
                cap, used = _tiers((await http.get("/metrics")).text)
                for tier, c in cap.items():
                    if c > 0:
                        ratio[tier] = max(ratio.get(tier, 0.0), used.get(tier, 0.0) / c)
                await asyncio.sleep(0.5)

        started = time.monotonic()
        await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
        elapsed = time.monotonic() - started
        after: dict[str, float] = {}
        for _ in range(20):  # aborted/finished requests free their pages within a step or two
            _, after = _tiers((await http.get("/metrics")).text, cached=False)
            if after == before:
                break
            await asyncio.sleep(0.25)
    total = {k: sum(per[c][k] for c in names) for k in ("requests", "errors", "tokens")}
    classes = {c: ClassResult(per[c]["requests"], per[c]["errors"], per[c]["tokens"], _pct(ttfts[c]), _pct(itls[c]))
               for c in names if c == "short" or long_clients}
    return LoadResult(clients, round(elapsed, 1), total["requests"], total["errors"], total["tokens"],
                      round(total["tokens"] / elapsed, 2), _pct(ttfts["long"] + ttfts["short"]),
                      _pct(itls["long"] + itls["short"]), {k: round(v, 3) for k, v in ratio.items()}, before, after,
                      classes)


def as_dict(result: LoadResult) -> dict:  # type: ignore[type-arg]
    return asdict(result)
