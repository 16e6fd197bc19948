"""A client that disconnects before its answer is ready has its request aborted within one engine step:
its slot and KV pages are free again, whether it streamed or not, before or after its first token.

A real `kvdrive serve` (demo model) gets a ~3K-token prompt (prefilled in 512-token chunks, several
engine steps); the client gives up during the prefill. Before, a non-streamed request kept generating
and a streamed one was still prefilled; the server stayed busy long after the client had gone.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import LiveServer, start_server

PROMPT = " ".join(f"word{i % 97}" for i in range(1000))  # ~2.9K tokens; each use starts differently (no prefix reuse)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("cancel"), "--gpu-budget", "256MiB", "--step-tokens", "512")
    yield live
    live.process.terminate()
    live.process.wait(30)


def _gauge(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def _idle_after(server: LiveServer, since: float) -> float:
    """Seconds from ``since`` until nothing runs or waits."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _gauge(server, "kvdrive_requests_running") == 0 and _gauge(server, "kvdrive_requests_waiting") == 0:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError("the server is still busy a minute after the client left")


def _step_seconds(server: LiveServer, tag: str) -> float:
    """A prefill step of this prompt's size, measured: the time one uninterrupted request takes per chunk."""
    start = time.monotonic()
    httpx.post(server.url + "/v1/completions", headers=server.headers(), timeout=300,
               json={"model": "demo", "prompt": f"timing {tag} " + PROMPT, "max_tokens": 1})
    return (time.monotonic() - start) / 6  # ~3K tokens in 512-token chunks


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_prefill_is_aborted_within_a_step(server: LiveServer, stream: bool) -> None:
    step = _step_seconds(server, str(stream))
    body = {"model": "demo", "prompt": f"{stream} " + PROMPT, "max_tokens": 200, "stream": stream}  # no shared prefix
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                          timeout=httpx.Timeout(10, read=1.0)) as r:
            for _ in r.iter_lines():  # streamed: the first token is still seconds away
                pass
    left = time.monotonic()
    took = _idle_after(server, left)
    print(f"stream={stream}: idle {took:.2f} s after the disconnect (a prefill step: {step:.2f} s)")
    assert took < 2 * step + 0.5, f"idle {took:.2f} s after the disconnect; a step takes {step:.2f} s"
    log = server.log.read_text()
    assert re.search(r"aborted \w+ after 0 tokens \(client went away\)", log), log[-2000:]


def test_a_streaming_client_that_leaves_after_its_first_token_is_aborted(server: LiveServer) -> None:
    body = {"model": "demo", "prompt": "Count: 1, 2,", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break  # got a token: hang up
    took = _idle_after(server, time.monotonic())
    print(f"after the first token: idle {took:.2f} s after the disconnect")
    assert took < 2.0, took

