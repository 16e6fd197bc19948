"""The shared tier between real ``kvdrive serve`` processes on a real 3-shard Valkey cluster (``valkeykit``):
a document asked on one server is reused by another with the same greedy output; a server killed and started
on an empty SSD directory warms from it; every kind of bad value is refused, counted and recomputed with the
output unchanged; tenants' salts never meet; a shard killed under streaming load degrades the tier (never a
5xx, outputs unchanged) and the tier recovers when it is back."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
import valkeykit
from liveservers import Server, all_ready, start, wait_ready

from kvdrive.runtime.kvcache.store.shared import PageFormat, cache_identity

pytestmark = pytest.mark.timeout(900)

PAGE = 16  # the servers' --page-size (the default)
# --gemm fp32: the tests compare greedy answers computed cold with answers from reused pages, and 4 concurrent
# streams whose chunks the pacer cuts by time. Under bf16 prompt GEMMs (auto on this host) a prompt's rows take
# bf16 or the float32 block kernels by their step's row count, which moves near-tied tokens (docs/weights.md:
# a cold and a reused prompt differ by ~0.02 in a log-probability); in float32 both paths agree to rounding,
# so an answer that changes is a page that changed
FLAGS = ("--gpu-budget", "64MiB", "--dram-budget", "32MiB", "--max-sequences", "4", "--max-running", "4",
         "--shared-tier-timeout-ms", "300", "--gemm", "fp32")


def document(n: int, words: int = 500) -> str:
    return f"Document {n}. " + " ".join(f"alpha{n}x{j} beta{j % 13} gamma" for j in range(words)) + "\nSummary:"


async def ask(server: Server, prompt: str, salt: str | None = None, max_tokens: int = 8) -> tuple[str, int, int]:
    """The greedy text, the prompt tokens reused (``cached_tokens``), and the most that could be: every full
    page before the prompt's last token."""
    body: dict[str, object] = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    async with httpx.AsyncClient() as client:
        rsp = await client.post(f"{server.url}/v1/completions", json=body, timeout=600)
    assert rsp.status_code == 200, rsp.text
    out = rsp.json()
    usage = out["usage"]
    return (out["choices"][0]["text"], int(usage["prompt_tokens_details"]["cached_tokens"]),
            (int(usage["prompt_tokens"]) - 1) // PAGE * PAGE)


async def metrics(server: Server, name: str) -> dict[str, float]:
    """Samples of one metric family: label values (joined) -> value."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{server.url}/metrics", timeout=10)).text
    found = re.findall(rf'^{re.escape(name)}(?:\{{(.*?)\}})? (\S+)$', text, re.MULTILINE)
    return {labels: float(value) for labels, value in found}


async def published_pages(server: Server) -> int:
    return int((await metrics(server, "kvdrive_shared_tier_published_pages_total")).get("", 0))


async def published(server: Server, at_least: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await published_pages(server) >= at_least:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"fewer than {at_least} pages published in {timeout} s")


async def readiness(server: Server) -> dict[str, object]:
    async with httpx.AsyncClient() as client:
        rsp = await client.get(f"{server.url}/readyz", timeout=10)
    assert rsp.status_code == 200  # a degraded tier keeps the server ready
    return dict(rsp.json())


@pytest.fixture(scope="module")
def cluster() -> Iterator[valkeykit.ValkeyDeployment]:
    with valkeykit.start(3, "512mb") as dep:
        yield dep


def serve(folder: Path, dep: valkeykit.ValkeyDeployment, *extra: str) -> Server:
    return start(folder, "admin-token", "--shared-tier", dep.url, "--shared-tier-namespace", "live", *FLAGS, *extra)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(cluster: valkeykit.ValkeyDeployment, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Server]]:
    root = tmp_path_factory.mktemp("shared-live")
    async with all_ready([serve(root / "a", cluster), serve(root / "b", cluster)]) as servers:
        yield servers


@pytest.mark.asyncio(loop_scope="module")
async def test_a_document_asked_on_one_server_is_reused_by_another_and_salts_stay_apart(pair: list[Server]) -> None:
    a, b = pair
    doc = document(1)
    before = await published_pages(a)
    text_a, cached, every = await ask(a, doc)
    assert cached == 0
    await published(a, before + every // PAGE)  # every full page of the prompt
    text_b, cached, every = await ask(b, doc)
    assert text_b == text_a and cached == every > 4000  # every full page before the last token: from the shared tier
    assert (await metrics(b, "kvdrive_shared_tier_hits_total"))[""] >= 30
    # a tenant's salt: never served another salt's (or no salt's) pages, on either server
    before = await published_pages(b)
    salted_b, cached, _ = await ask(b, doc, salt="tenant-x")
    assert cached == 0 and salted_b == text_a
    await published(b, before + every // PAGE)
    _, cached, every = await ask(a, doc, salt="tenant-x")  # the same salt on the other server: shared
    assert cached == every
    _, cached, _ = await ask(a, doc, salt="tenant-y")
    assert cached == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_every_bad_value_is_refused_counted_and_recomputed_with_the_same_output(
        pair: list[Server], cluster: valkeykit.ValkeyDeployment) -> None:
    a, b = pair
    doc = document(2)
    before = await published_pages(a)
    clean, _, every = await ask(a, doc)
    await published(a, before + every // PAGE)
    rc = valkeykit.cluster_client(cluster)
    keys = sorted(k for k in rc.scan_iter(match="kvd:live:*", count=1000))
    # the document's pages are the keys A published last: tamper with every value of the namespace, one way
    # each, in turn (the other document's pages are tampered too; it is not asked again)
    other_model = PageFormat(cache_identity("another model|float16|16"), 30, 24576)
    for i, key in enumerate(keys):
        value, swap = rc.get(key), rc.get(keys[(i + 1) % len(keys)])
        if value is None or swap is None:  # evicted by the store meanwhile
            continue
        kind = i % 4
        if kind == 0:
            flipped = bytearray(value)
            flipped[len(value) // 2] ^= 0x40
            rc.set(key, bytes(flipped))
        elif kind == 1:
            rc.set(key, value[: len(value) // 3])
        elif kind == 2:
            rc.set(key, swap)
        else:
            digest = bytes.fromhex(key.decode().rsplit(":", 1)[1])
            rc.set(key, other_model.encode(digest, torch.zeros(30, 24576, dtype=torch.uint8)))
    text, cached, _ = await ask(b, doc)
    assert text == clean and cached == 0
    failures = await metrics(b, "kvdrive_shared_tier_verify_failures_total")
    for cause in ("checksum", "truncated", "digest", "identity"):
        assert failures[f'cause="{cause}"'] >= 1, failures


@pytest.mark.asyncio(loop_scope="module")
async def test_a_server_killed_and_started_on_an_empty_ssd_warms_from_the_shared_tier(
        pair: list[Server], cluster: valkeykit.ValkeyDeployment, tmp_path: Path) -> None:
    a, _ = pair
    doc = document(3)
    before = await published_pages(a)
    clean, _, every = await ask(a, doc)
    await published(a, before + every // PAGE)
    a.process.kill()  # kill -9: nothing flushed, nothing said goodbye
    a.process.wait()
    fresh = serve(tmp_path / "a2", cluster)  # a new, empty SSD directory
    try:
        await wait_ready(fresh)
        text, cached, every = await ask(fresh, doc)
        assert text == clean and cached == every > 4000
        assert (await metrics(fresh, "kvdrive_shared_tier_prefix_pages_total"))[""] >= 30
    finally:
        fresh.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_shard_killed_under_load_degrades_the_tier_and_it_recovers(
        pair: list[Server], cluster: valkeykit.ValkeyDeployment) -> None:
    _, b = pair
    docs = [document(10 + i, 300) for i in range(4)]
    # the references: the same 4 streams, concurrent like the leg under test (a batch of 4 and a batch of 1 may
    # round a near tie apart), under a salt of their own so that their pages are not the ones fetched below
    refs = await asyncio.gather(*(ask(b, d, salt="refs", max_tokens=12) for d in docs))
    victim = cluster.nodes[0]
    victim.kill()
    try:
        # 4 streams (each a document new to the tier, so its pages are fetched and published while a shard is
        # gone): every answer is 200 and equals the reference
        outs = await asyncio.gather(*(ask(b, d, max_tokens=12) for d in docs))
        assert [t for t, _, _ in outs] == [t for t, _, _ in refs], "an answer changed while a shard was down"
        ready = await readiness(b)
        assert ready["status"] == "degraded" and "shared" in ready["degraded"]  # type: ignore[operator]
        assert (await metrics(b, "kvdrive_shared_tier_degraded"))[""] == 1.0
    finally:
        victim.start()
    deadline = time.monotonic() + 60
    while (await readiness(b))["status"] != "ready":
        assert time.monotonic() < deadline, "the shared tier stayed degraded after its shard came back"
        await asyncio.sleep(0.5)
    assert (await metrics(b, "kvdrive_shared_tier_degraded"))[""] == 0.0
