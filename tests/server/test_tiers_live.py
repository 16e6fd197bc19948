"""Live tier control and persistence against real `kvdrive serve` processes on the demo model.

- PUT /admin/tiers shrinks the device and DRAM budgets while a request streams: the output is the same
  as without the change, usage is under the new budgets right after, impossible budgets get a 422
  (a malformed body a 400).
- A server stopped with SIGTERM or killed with SIGKILL and started again on the same --ssd-dir answers
  the same prompt identically, reading its prefix pages from the SSD tier instead of recomputing them.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN_TOKEN, API_KEY, LiveServer, start_server

TEXT = ("The history of the city begins with a small settlement on the river bank, where traders met to "
        "exchange grain, salt and cloth. Over the centuries the town grew, built walls and bridges, and became "
        "the seat of a bishop and later of a royal court. ")
MiB = 1 << 20


def _admin(server: LiveServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _complete(server: LiveServer, prompt: str, n: int) -> str:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(API_KEY), timeout=300,
                   json={"model": "demo", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _tiers(server: LiveServer) -> dict[str, dict[str, int]]:
    r = httpx.get(server.url + "/admin/tiers", headers=_admin(server), timeout=30)
    assert r.status_code == 200, r.text
    return {t["tier"]: t for t in r.json()["tiers"]}


def test_put_admin_tiers_shrinks_budgets_during_generation(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--gpu-budget", "96MiB", "--dram-budget", "64MiB", "--ssd-dir",
                          str(tmp_path / "ssd"), "--ssd-budget", "512MiB", "--max-running", "4")
    try:
        prompt = TEXT * 16  # ~700 tokens
        reference = _complete(server, prompt, 32)
        assert httpx.put(server.url + "/admin/tiers", json={"gpu_bytes": 64 * MiB, "dram_bytes": 0,
                         "ssd_bytes": 0}, timeout=30).status_code == 401  # admin token required
        chunks: list[str] = []
        shrunk: dict[str, dict[str, int]] = {}
        body = {"model": "demo", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(API_KEY), json=body,
                          timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
                if len(chunks) == 5:  # mid-generation: shrink the device and DRAM tiers
                    put = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=60,
                                    json={"gpu_bytes": 16 * MiB, "dram_bytes": 8 * MiB, "ssd_bytes": 512 * MiB})
                    assert put.status_code == 200, put.text
                    shrunk = {t["tier"]: t for t in put.json()["tiers"]}
        assert "".join(chunks) == reference
        assert shrunk["gpu"]["budget_bytes"] == 16 * MiB and shrunk["dram"]["budget_bytes"] == 8 * MiB
        for name, t in _tiers(server).items():
            assert t["used_bytes"] + t["cached_bytes"] <= t["capacity_bytes"] <= max(t["budget_bytes"], 0), name
        bad = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=30,
                        json={"gpu_bytes": 1024, "dram_bytes": 0, "ssd_bytes": 512 * MiB})
        assert bad.status_code == 422 and "no room for KV pages" in bad.json()["error"]["message"]
        typo = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=30,
                         json={"gpu_bytes": "lots", "dram_bytes": 0, "ssd_bytes": 0})
        assert typo.status_code == 400 and typo.json()["error"]["param"] == "gpu_bytes"  # a wrong type: 400
        assert _tiers(server)["gpu"]["budget_bytes"] == 16 * MiB  # refused changes changed nothing
    finally:
        server.process.terminate()
        server.process.wait(60)


def test_put_admin_tiers_moves_the_envelope_split_between_hot_tier_and_concurrency(tmp_path: Path) -> None:
    """One 48 MiB envelope: raising max_running from 4 to 8 takes four step buffers from the hot tier,
    lowering it to 1 while a request streams gives them back once that request runs alone, and the
    stream's text is the same as without the change. /metrics says all of it; a limit past
    --max-sequences is a 422 with the reason, an empty body a 400."""
    server = start_server(tmp_path, "--gpu-budget", "48MiB", "--dram-budget", "32MiB", "--ssd-dir",
                          str(tmp_path / "ssd"), "--ssd-budget", "256MiB", "--max-running", "4",
                          "--max-sequences", "8")
    try:
        prompt = TEXT * 4
        reference = _complete(server, prompt, 24)
        split = httpx.get(server.url + "/admin/tiers", headers=_admin(server), timeout=30).json()["split"]
        assert (split["max_running"], split["max_sequences"], split["envelope_bytes"]) == (4, 8, 48 * MiB)
        per_seq = split["per_sequence_bytes"]
        assert per_seq > 0 and split["hot_bytes"] + split["reserve_bytes"] == 48 * MiB
        up = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=60, json={"max_running": 8})
        assert up.status_code == 200, up.text
        assert up.json()["split"]["hot_bytes"] == split["hot_bytes"] - 4 * per_seq
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert _metric(metrics, "kvdrive_max_running") == 8
        assert _metric(metrics, "kvdrive_gpu_hot_bytes") == split["hot_bytes"] - 4 * per_seq
        assert _metric(metrics, "kvdrive_sequence_reserve_per_sequence_bytes") == per_seq
        assert "kvdrive_queue_wait_seconds_total" in metrics
        chunks: list[str] = []
        body = {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(API_KEY), json=body,
                          timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(chunks) == 3:
                        down = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=60,
                                         json={"max_running": 1})
                        assert down.status_code == 200, down.text
        assert "".join(chunks) == reference
        after = httpx.get(server.url + "/admin/tiers", headers=_admin(server), timeout=30).json()["split"]
        assert after["max_running"] == 1 and after["pending_max_running"] is None
        assert after["hot_bytes"] == split["hot_bytes"] + 3 * per_seq
        past = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=30, json={"max_running": 9})
        assert past.status_code == 422 and "--max-sequences" in past.json()["error"]["message"]
        empty = httpx.put(server.url + "/admin/tiers", headers=_admin(server), timeout=30, json={})
        assert empty.status_code == 400 and "at least one" in empty.json()["error"]["message"]
        assert _tiers(server)["gpu"]["budget_bytes"] == 48 * MiB
    finally:
        server.process.terminate()
        server.process.wait(60)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_prefix_pages_are_reused_after_a_restart(tmp_path: Path, stop: signal.Signals) -> None:
    ssd = tmp_path / "ssd"
    flags = ("--gpu-budget", "48MiB", "--dram-budget", "16MiB", "--ssd-dir", str(ssd), "--ssd-budget", "256MiB",
             "--max-running", "4")
    prompt = TEXT * 15  # ~650 tokens: 40 full pages
    (tmp_path / "a").mkdir()
    first = start_server(tmp_path / "a", *flags)
    try:
        out1 = _complete(first, prompt, 16)
        pages = 0
        for _ in range(200):  # write-through to the SSD tier is asynchronous: wait until it landed
            ssd_tier = _tiers(first)["ssd"]
            pages = ssd_tier["pages"]
            if pages >= 40 * 30:
                break
            httpx.get(first.url + "/healthz", timeout=5)
        assert pages >= 40 * 30
    finally:
        first.process.send_signal(stop)
        first.process.wait(60)
    (tmp_path / "b").mkdir()
    second = start_server(tmp_path / "b", *flags)
    try:
        assert _complete(second, prompt, 16) == out1
        text = httpx.get(second.url + "/metrics", timeout=30).text
        assert _metric(text, "kvdrive_prefix_hit_pages_total") >= 40
        assert _metric(text, "kvdrive_page_reads_total", '{tier="ssd"}') >= 40 * 30
    finally:
        second.process.terminate()
        second.process.wait(60)
