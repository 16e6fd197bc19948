"""The fault bench's clients and probes against a real `kvdrive serve`: greedy requests (one by one, or
clients cycling prompts for a while), their summary against the clean server's answers, and what the
server itself says (/readyz, the fault metrics, the SSD tier in /admin/tiers).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))  # the live tests' launcher

from liveservers import Server


# --- requests ----------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    status: str  # HTTP status, or the exception's name when no answer came
    seconds: float
    text: str = ""
    finish: str = ""
    identical: bool | None = None


async def greedy(client: httpx.AsyncClient, server: Server, name: str, prompt: str, max_tokens: int) -> Result:
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{server.url}/v1/completions", timeout=600, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError as exc:
        return Result(name, type(exc).__name__, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return Result(name, str(r.status_code), seconds, r.text[:2000])
    choice = r.json()["choices"][0]
    return Result(name, "200", seconds, choice["text"], str(choice.get("finish_reason")))


def judge(results: list[Result], ref: dict[str, str]) -> None:
    for r in results:
        r.identical = r.status == "200" and r.text == ref.get(r.name)


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2), "n": len(values)}


def summarize(results: list[Result], ref: dict[str, str]) -> dict[str, Any]:
    judge(results, ref)
    status: dict[str, int] = {}
    finish: dict[str, int] = {}
    for r in results:
        status[r.status] = status.get(r.status, 0) + 1
        if r.finish:
            finish[r.finish] = finish.get(r.finish, 0) + 1
    return {
        "requests": len(results), "status": status, "http_5xx": sum(n for s, n in status.items() if s.startswith("5")),
        "no_answer": sum(n for s, n in status.items() if not s.isdigit()), "finish_reasons": finish,
        "identical": sum(bool(r.identical) for r in results),
        "different": [{"prompt": r.name, "status": r.status, "got": r.text[:120], "want": ref.get(r.name, "")[:120]}
                      for r in results if not r.identical][:10],
        "latency_s": pct([r.seconds for r in results if r.status == "200"]),
        "errors": error_messages(results),
    }


def error_messages(results: list[Result]) -> dict[str, int]:
    """Distinct error messages of the answers that were not 200 (numbers and hashes blanked), with counts."""
    out: dict[str, int] = {}
    for r in results:
        if r.status == "200":
            continue
        try:
            message = json.loads(r.text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text or r.status
        key = f"{r.status}: " + re.sub(r"BlockKey\([^)]*\)", "BlockKey(..)", message)[:140]
        out[key] = out.get(key, 0) + 1
    return out


async def sequential(server: Server, named: list[tuple[str, str]], max_tokens: int, desc: str) -> list[Result]:
    async with httpx.AsyncClient() as client:
        return [await greedy(client, server, n, p, max_tokens) for n, p in tqdm(named, desc=desc)]


async def load(server: Server, named: list[tuple[str, str]], seconds: float, clients: int, max_tokens: int,
               desc: str, halfway: Any = None) -> list[Result]:
    """``clients`` greedy clients cycling through ``named`` for ``seconds``; ``halfway()`` runs at half time."""
    results: list[Result] = []
    deadline = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient, w: int) -> None:
        n = w * max(1, len(named) // clients)
        while time.monotonic() < deadline:
            name, p = named[n % len(named)]
            results.append(await greedy(client, server, name, p, max_tokens))
            n += 1

    async def clock() -> None:
        with tqdm(total=int(seconds), desc=desc) as bar:
            done_half = False
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(1.0, left))
                bar.n = int(seconds - max(0.0, deadline - time.monotonic()))
                bar.refresh()
                if halfway is not None and not done_half and time.monotonic() > deadline - seconds / 2:
                    done_half = True
                    halfway()

    async with httpx.AsyncClient() as client:
        await asyncio.gather(clock(), *(client_loop(client, w) for w in range(clients)))
    return results


# --- the server's view ---------------------------------------------------------------------------------
def metrics_of(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(kvdrive_[a-z_]+)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + labels] = float(value)
    return out


def labeled(m: dict[str, float], metric: str) -> dict[str, float]:
    """{"tier/kind" or "tier": value} of one labeled metric."""
    out: dict[str, float] = {}
    for key, value in m.items():
        if key.startswith(metric + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            out["/".join(labels[k] for k in ("tier", "kind", "outcome") if k in labels)] = value
    return out


async def probe(server: Server) -> dict[str, Any]:
    """/readyz, the fault metrics and the SSD tier as /admin/tiers reports it."""
    async with httpx.AsyncClient(timeout=30) as client:
        rz = await client.get(f"{server.url}/readyz")
        m = metrics_of((await client.get(f"{server.url}/metrics")).text)
        tiers = (await client.get(f"{server.url}/admin/tiers", headers=server.admin())).json()["tiers"]
        models = (await client.get(f"{server.url}/v1/models")).json()["data"]
    ssd = next((t for t in tiers if t["tier"] == "ssd"), {})
    try:
        body: Any = rz.json()
    except ValueError:
        body = rz.text
    return {
        "readyz": {"status": rz.status_code, "body": body},
        "faults": labeled(m, "kvdrive_tier_faults_total"), "degraded": labeled(m, "kvdrive_tier_degraded"),
        "ssd_blocks": ssd.get("pages"), "ssd_capacity_bytes": ssd.get("capacity_bytes"),
        "ssd_errors": ssd.get("errors"), "page_misses": m.get("kvdrive_page_misses_total"),
        "prefix_hit_pages": m.get("kvdrive_prefix_hit_pages_total"),
        "page_reads": labeled(m, "kvdrive_page_reads_total"), "max_model_len": models[0].get("max_model_len"),
    }
