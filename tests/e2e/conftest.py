"""Fixtures of the end-to-end scenarios: the one-node cluster (``scripts/cluster.sh``), the operator
installed with Helm, and the scenarios' KVDriveDeployment (``demo.yaml``) deployed and Ready.

The cluster needs root on Linux and Go (or the binaries already built). ``make test`` builds them
and the images first. ``KVDRIVE_E2E_DIR=DIR`` reuses a cluster you brought up with
``scripts/cluster.sh up DIR`` and leaves it running.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clusterkit import (
    FIGURES,
    NAMESPACE,
    OPERATOR_NAMESPACE,
    RELEASE,
    Cluster,
    cluster_down,
    cluster_reap,
    cluster_up,
    eventually,
    host_state,
)

CR_FILE = Path(__file__).resolve().parent / "demo.yaml"
GIE_CRD = (Path(__file__).resolve().parents[1] / "operator" / "data" / "gateway-api-inference-extension"
           / "inference.networking.k8s.io_inferencepools.yaml")
CACHE = Path(os.environ.get("KVDRIVE_CLUSTER_CACHE", Path.home() / ".cache" / "kvdrive" / "cluster"))


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "the one-node cluster runs on Linux only"
    if os.geteuid() != 0:
        return "the one-node cluster needs root (mounts, iptables, cgroups, hugepages)"
    if shutil.which("go") is None and not any(CACHE.glob("kubernetes-v*/kubelet")):
        return "no Go on PATH and no cluster binaries built (scripts/cluster.sh build)"
    return None


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = _why_not()
    if why:
        pytest.skip(why)
    FIGURES.unlink(missing_ok=True)
    reuse = os.environ.get("KVDRIVE_E2E_DIR")
    if reuse:
        yield Cluster(Path(reuse), owned=False, host_before=None)
        return
    directory = tmp_path_factory.mktemp("cluster")
    cluster_reap()
    before = host_state()
    started = time.monotonic()
    cluster_up(directory)
    c = Cluster(directory, owned=True, host_before=before)
    c.record("cluster up (s)", round(time.monotonic() - started, 1))
    yield c
    if (directory / "pids" / "kube-apiserver.pid").exists():  # the last scenario did not take it down
        cluster_down(directory)
    shutil.rmtree(directory / "nvme", ignore_errors=True)  # the pods' volumes: gigabytes; the logs stay


@pytest.fixture(scope="session")
def operator(cluster: Cluster) -> Cluster:
    """The chart installed as the README says (idempotent: a reused cluster may have it)."""
    if cluster.run("helm", "status", RELEASE, "-n", OPERATOR_NAMESPACE, check=False).returncode != 0:
        started = time.monotonic()
        cluster.run("helm", "install", RELEASE, "charts/kvdrive-operator", "-n", OPERATOR_NAMESPACE,
                    "--create-namespace", "--wait", "--timeout", "5m")
        cluster.record("helm install --wait (s)", round(time.monotonic() - started, 1))
    return cluster


@pytest.fixture(scope="session")
def deployed(operator: Cluster) -> Cluster:
    """The scenarios' CR applied and Ready (the time from `kubectl apply` to Ready is recorded)."""
    c = operator
    if c.kubectl("get", "kvd", "demo", "-n", NAMESPACE, check=False).returncode != 0:
        c.kubectl("create", "namespace", NAMESPACE, check=False)
        # the platform's Gateway API Inference Extension CRDs (the CR's routing mode renders an InferencePool)
        c.kubectl("apply", "-f", str(GIE_CRD))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferencepools.inference.networking.k8s.io")
        started = time.monotonic()
        c.kubectl("apply", "-f", "-", input=demo_cr(c))
        eventually(lambda: _cr_ready(c), 600, what="the CR's Ready condition")
        c.record("kubectl apply -> CR Ready (s)", round(time.monotonic() - started, 1))
    eventually(lambda: _cr_ready(c), 600, what="the CR's Ready condition")
    return c


def demo_cr(c: Cluster) -> str:
    """demo.yaml, its shared tier pointed at the Valkey shards this cluster's ``up`` started."""
    cr = yaml.safe_load(CR_FILE.read_text())
    cr["spec"]["tiers"]["shared"]["endpoints"] = c.shared_tier_endpoints
    return yaml.safe_dump(cr)


def _cr_ready(c: Cluster) -> bool:
    cr = c.get("kvd", "demo", "-n", NAMESPACE)
    conditions = {x["type"]: x for x in cr.get("status", {}).get("conditions", [])}
    ready = conditions.get("Ready", {})
    return ready.get("status") == "True" and ready.get("observedGeneration") == cr["metadata"]["generation"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    c = getattr(item, "funcargs", {}).get("cluster") or next(
        (v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Cluster)), None)
    if report.failed and call.when == "call" and isinstance(c, Cluster) and c.kubeconfig.exists():
        report.sections.append(("cluster diagnostics", c.diagnostics()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES.exists():
        terminalreporter.write_sep("-", "one-node cluster figures")
        terminalreporter.write_line(FIGURES.read_text())
