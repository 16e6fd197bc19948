"""`kvdrive-operator run` as a process: logs in from KUBECONFIG, serves its liveness probe, reconciles."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
from crdcheck import load_example
from kopfenv import Cluster, eventually

from kvdrive.operator.act.objects import CR, STATEFULSETS

CLI = Path(sys.executable).with_name("kvdrive-operator")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_run_serves_liveness_and_reconciles(cluster: Cluster, tmp_path: Path) -> None:
    kubeconfig = cluster.plane.kubeconfig
    port = _free_port()
    log = (tmp_path / "operator.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        str(CLI), "run", "-n", cluster.namespace, "--liveness", f"http://127.0.0.1:{port}/healthz", cwd="/",
        env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"},
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        async def alive() -> bool:
            try:
                async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as rsp:
                    return rsp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(alive, timeout=30, what="the liveness endpoint")
        await cluster.storage_class()
        await cluster.create(CR, load_example("minimal.yaml"))
        sts = await eventually(lambda: cluster.get(STATEFULSETS, "demo"), timeout=30,
                               what="the StatefulSet")
        assert sts["spec"]["template"]["spec"]["containers"][0]["args"][:3] == ["serve", "--model", "demo"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=20)
        except TimeoutError:
            process.kill()
            await process.wait()
        log.close()
    output = (tmp_path / "operator.log").read_text()
    assert "Traceback" not in output, output[-3000:]
    assert "creating StatefulSet demo" in output
