"""SIGTERM (what Kubernetes sends) runs the graceful shutdown of a real `kvdrive serve` process: the
request in flight finishes, the listener closes, write-backs finish, the SSD index is flushed, and the
process exits 0. (uvicorn re-raised the signal after its own shutdown, killing the process before
that cleanup: exit status -15, no "stopped" line.)"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
from conftest import start_server


def test_sigterm_drains_in_flight_requests_flushes_and_exits_0(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--ssd-dir", str(tmp_path / "ssd"), "--ssd-budget", "64MiB", "--drain-seconds",
                          "30")
    first_token, result = threading.Event(), {}

    def stream() -> None:
        body = {"model": "demo", "prompt": "Count: 1, 2, 3,", "max_tokens": 48, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, reason = [], None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    reason = choice["finish_reason"] or reason
                    first_token.set()
        result.update(status=r.status_code, reason=reason, chunks=len(text))

    client = threading.Thread(target=stream)
    client.start()
    assert first_token.wait(120), server.log.read_text()[-2000:]
    server.process.send_signal(signal.SIGTERM)
    client.join(120)
    assert server.process.wait(60) == 0, server.log.read_text()[-3000:]
    assert result == {"status": 200, "reason": "length", "chunks": 48}, result
    log = server.log.read_text()
    assert "shutting down" in log and log.rstrip().endswith("stopped"), log[-2000:]
    assert "Traceback" not in log
