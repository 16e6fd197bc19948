"""A failing tier shows in /readyz and the metrics, and the server keeps serving correctly without it.

The SSD tier's directory cannot be created (its parent is a file), so the tier is unavailable from the
start: /readyz stays 200 (the pod keeps serving from gpu and dram) but says "degraded" and why, and the
metrics carry the fault and ``kvdrive_tier_degraded{tier="ssd"} 1`` for alerting. A healthy server says
"ready" and 0.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from kvdrive.runtime.engine import EngineConfig, SchedulerConfig, TierConfig
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.serve import ServeOptions, build_state


def _gauge(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{{{labels}}} missing"
    return float(m.group(1))


def test_healthy_server_is_ready_and_not_degraded(tiny_state) -> None:  # type: ignore[no-untyped-def]
    client = TestClient(create_app(tiny_state))
    assert client.get("/readyz").json() == {"status": "ready", "degraded": {}}
    assert _gauge(client.get("/metrics").text, "kvdrive_tier_degraded", 'tier="ssd"') == 0


def test_unavailable_ssd_tier_is_reported_and_requests_are_served(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    opts = ServeOptions(model=str(tiny_model), served_model_name="tiny", progress=False,
                        scheduler=SchedulerConfig(max_waiting=8),
                        engine=EngineConfig(tiers=TierConfig(ssd_bytes=8 << 20, ssd_dir=str(tmp_path / "file" / "kv"))))
    state = build_state(opts)
    state.engine.start()
    try:
        client = TestClient(create_app(state))
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert "unavailable" in ready.json()["degraded"]["ssd"]
        text = client.get("/metrics").text
        assert _gauge(text, "kvdrive_tier_degraded", 'tier="ssd"') == 1
        assert _gauge(text, "kvdrive_tier_faults_total", 'kind="ENOTDIR",tier="ssd"') == 1
        rsp = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                   "temperature": 0})
        assert rsp.status_code == 200 and rsp.json()["usage"]["completion_tokens"] == 4
    finally:
        state.engine.shutdown()
