"""The operator at scale against a real API server: 50 KVDriveDeployments created at once, then 50 spec
changes.

Starts its own control plane (``scripts/control-plane.sh``), installs the CRD and the chart's RBAC, and
runs ``kvdrive-operator run`` as a subprocess with a token of the chart's ServiceAccount only (as in a
cluster). Measures:
- the time from the first create until every CR has all its children and ``observedGeneration`` 1;
- API requests the operator sent (from the API server's audit log, by its ServiceAccount), per CR;
- the operator's RSS and CPU time (from /proc, sampled);
- then 50 spec changes at once, and the time until every StatefulSet carries the change and every
  CR reports ``observedGeneration`` 2.
There are no nodes: pods never run, so no live-loop metrics rounds happen (the daemons still start).

    python bench/operator_scale.py [--crs 50] [--out bench/results/operator-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubernetes import client, config, dynamic
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "control-plane.sh"
NAMESPACE = "scale"
LABELS = "app.kubernetes.io/managed-by=kvdrive-operator"
CHILD_KINDS = (("v1", "ConfigMap", 1), ("v1", "Secret", 1), ("v1", "Service", 2), ("apps/v1", "StatefulSet", 1),
               ("policy/v1", "PodDisruptionBudget", 1))


def _chart_rbac() -> list[dict[str, Any]]:
    import helm_python

    with helm_python.Chart.load(REPO / "charts" / "kvdrive-operator") as chart:
        rendered = chart.render(values={}, name="kvd", namespace=NAMESPACE, is_install=True)
    docs = [d for template, text in rendered.items() if not template.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    return [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]


class Sampler(threading.Thread):
    """Peak RSS and total CPU seconds of one process, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process, self.peak_rss, self.stop = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return float(times.user + times.system)


def _audit(path: Path, user: str, since: int) -> list[dict[str, Any]]:
    with path.open("rb") as handle:
        handle.seek(since)
        events = [json.loads(line) for line in handle if line.strip()]
    return [e for e in events if e["user"]["username"] == user]


def _summary(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for e in events:
        ref = e.get("objectRef") or {}
        what = ref.get("resource", "discovery") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        counts[f"{e['verb']} {what}"] += 1
    return dict(counts.most_common())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crs", type=int, default=50)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "operator-scale"))
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="kvdrive-scale-"))
    subprocess.run(["bash", str(SCRIPT), "up", str(state)], check=True)
    operator: subprocess.Popen[bytes] | None = None
    try:
        admin = config.new_client_from_config(str(state / "kubeconfig"))
        dyn = dynamic.DynamicClient(admin)
        crd = yaml.safe_load((REPO / "crds" / "kvdrivedeployment.yaml").read_text())
        dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition").server_side_apply(
            body=crd, name=crd["metadata"]["name"], field_manager="bench", force_conflicts=True)
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": NAMESPACE}})
        dyn.resources.get(api_version="storage.k8s.io/v1", kind="StorageClass").create(body={
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local-nvme"},
            "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"})
        for obj in _chart_rbac():
            dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).server_side_apply(
                body=obj, name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"),
                field_manager="helm", force_conflicts=True)
        account = next(o for o in _chart_rbac() if o["kind"] == "ServiceAccount")["metadata"]["name"]
        token = client.CoreV1Api(admin).create_namespaced_service_account_token(
            account, NAMESPACE, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
        ).status.token
        kubeconfig = yaml.safe_load((state / "kubeconfig").read_text())
        kubeconfig["users"][0]["user"] = {"token": token}
        (state / "operator-kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        time.sleep(1.0)  # the CRD becomes served

        user = f"system:serviceaccount:{NAMESPACE}:{account}"
        log = (state / "operator.log").open("wb")
        cli = shutil.which("kvdrive-operator") or str(Path(sys.executable).with_name("kvdrive-operator"))
        operator = subprocess.Popen([cli, "run", "--all-namespaces"],  # as the chart's Deployment runs it
                                    env={**os.environ, "KUBECONFIG": str(state / "operator-kubeconfig")},
                                    stdout=log, stderr=subprocess.STDOUT, cwd="/")
        sampler = Sampler(operator.pid)
        sampler.start()
        time.sleep(5.0)  # Kopf scans the API and starts its watches
        startup_cpu = sampler.cpu_seconds()
        audit = state / "audit.log"
        offset = audit.stat().st_size

        crs = dyn.resources.get(api_version="kvdrive.io/v1alpha1", kind="KVDriveDeployment")
        minimal = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())

        def make(i: int) -> None:
            body = json.loads(json.dumps(minimal))
            body["metadata"] = {"name": f"scale-{i:02d}", "namespace": NAMESPACE}
            crs.create(body=body, namespace=NAMESPACE)

        def converged(generation: int, budget: str | None) -> tuple[int, int]:
            """(CRs with every child, CRs whose status observed ``generation`` and whose StatefulSet has ``budget``)."""
            have: Counter[str] = Counter()
            for api_version, kind, per_cr in CHILD_KINDS:
                items = dyn.resources.get(api_version=api_version, kind=kind).get(
                    namespace=NAMESPACE, label_selector=LABELS).to_dict()["items"]
                for item in items:
                    have[item["metadata"]["labels"]["app.kubernetes.io/instance"]] += 1 / per_cr
                    if kind == "StatefulSet" and budget is not None:
                        args = item["spec"]["template"]["spec"]["containers"][0]["args"]
                        if args[args.index("--gpu-budget") + 1] != budget:
                            have[item["metadata"]["labels"]["app.kubernetes.io/instance"]] -= 100
            complete = sum(1 for v in have.values() if v >= len(CHILD_KINDS) - 1e-9)
            observed = sum(1 for cr in crs.get(namespace=NAMESPACE).to_dict()["items"]
                           if (cr.get("status") or {}).get("observedGeneration") == generation
                           and have[cr["metadata"]["name"]] >= len(CHILD_KINDS) - 1e-9)
            return complete, observed

        def wait(label: str, generation: int, budget: str | None) -> float:
            start = time.monotonic()
            with tqdm(total=args.crs, desc=label, unit="CR") as bar:
                while time.monotonic() - start < args.timeout:
                    _, done = converged(generation, budget)
                    bar.update(done - bar.n)
                    if done == args.crs:
                        return time.monotonic() - start
                    time.sleep(0.5)
            raise SystemExit(f"{label}: not converged after {args.timeout} s; see {state / 'operator.log'}")

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(make, range(args.crs)))
        created_in = time.monotonic() - t0
        create_s = wait("create: children + status", 1, None) + created_in
        cpu_after_create = sampler.cpu_seconds()
        time.sleep(2.0)
        create_events = _audit(audit, user, offset)
        offset = audit.stat().st_size

        def change(i: int) -> None:
            crs.patch(name=f"scale-{i:02d}", namespace=NAMESPACE, body={"spec": {"tiers": {"gpu": {"budget": "6Gi"}}}},
                      content_type="application/merge-patch+json")

        t1 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(change, range(args.crs)))
        t1 = time.monotonic() - t1  # the patches themselves; the wait below starts after them
        change_s = wait("spec change: StatefulSets + status", 2, str(6 << 30)) + t1
        cpu_after_change = sampler.cpu_seconds()
        time.sleep(2.0)
        change_events = _audit(audit, user, offset)
        sampler.stop.set()
        result = {
            "crs": args.crs,
            "host": f"{os.cpu_count()} cores (sched_getaffinity {len(os.sched_getaffinity(0))})",
            "kube_apiserver": client.VersionApi(admin).get_code().git_version,
            "create": {"seconds_to_all_children_and_status": round(create_s, 2),
                       "api_requests": len(create_events), "api_requests_per_cr": round(len(create_events) / args.crs, 1),
                       "by_call": _summary(create_events),
                       "operator_cpu_seconds": round(cpu_after_create - startup_cpu, 2)},
            "change": {"seconds_to_converge": round(change_s, 2),
                       "api_requests": len(change_events), "api_requests_per_cr": round(len(change_events) / args.crs, 1),
                       "by_call": _summary(change_events),
                       "operator_cpu_seconds": round(cpu_after_change - cpu_after_create, 2)},
            "operator_peak_rss_mib": round(sampler.peak_rss / 2**20, 1),
            "operator_startup_cpu_seconds": round(startup_cpu, 2),
        }
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(_markdown(result))
        print(_markdown(result))
        return 0
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                operator.kill()
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], check=False)


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Operator at scale (real kube-apiserver, no nodes)", "",
        f"{r['crs']} KVDriveDeployments created at once, then {r['crs']} spec changes at once; the operator as a "
        f"subprocess with the chart's ServiceAccount token; {r['kube_apiserver']}; host {r['host']}. "
        "Pods never run (no nodes).", "",
        "| phase | seconds to converge | API requests | per CR | operator CPU s |",
        "| --- | --- | --- | --- | --- |",
        f"| create | {r['create']['seconds_to_all_children_and_status']} | {r['create']['api_requests']} | "
        f"{r['create']['api_requests_per_cr']} | {r['create']['operator_cpu_seconds']} |",
        f"| spec change | {r['change']['seconds_to_converge']} | {r['change']['api_requests']} | "
        f"{r['change']['api_requests_per_cr']} | {r['change']['operator_cpu_seconds']} |", "",
        f"Operator peak RSS: {r['operator_peak_rss_mib']} MiB (startup CPU {r['operator_startup_cpu_seconds']} s).", "",
        "Requests by call (create / change):", "",
        "| call | create | change |", "| --- | --- | --- |",
    ]
    calls = sorted(set(r["create"]["by_call"]) | set(r["change"]["by_call"]))
    lines += [f"| {c} | {r['create']['by_call'].get(c, 0)} | {r['change']['by_call'].get(c, 0)} |" for c in calls]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
