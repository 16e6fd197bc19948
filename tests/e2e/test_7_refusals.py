"""Scene 7: the user makes mistakes. `kubectl apply` of a CR that breaks a rule is refused by the
API server with the CRD's CEL message, and nothing of it is created.
"""

from __future__ import annotations

import pytest
from clusterkit import NAMESPACE, Cluster

BAD = {
    "a DRAM size that is not whole hugepages": (
        "tiers: {dram: {size: 3Mi, hugePageSize: 2Mi}}",
        "spec.tiers.dram.size must be a whole number of hugepages of spec.tiers.dram.hugePageSize"),
    "replicas with operator autoscaling": (
        "replicas: 2\n  autoscaling: {mode: operator}",
        "spec.replicas must not be set when spec.autoscaling.mode is operator"),
    "a token budget that is not whole pages": (
        "attention: {tokenBudget: 1000, pageSize: 16}",
        "spec.attention.tokenBudget must be a multiple of spec.attention.pageSize"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_cr_is_refused_with_its_cel_message(operator: Cluster, case: str) -> None:
    c = operator
    c.kubectl("create", "namespace", NAMESPACE, check=False)
    extra, message = BAD[case]
    manifest = (f"apiVersion: kvdrive.io/v1alpha1\nkind: KVDriveDeployment\nmetadata: {{name: bad, namespace: {NAMESPACE}}}\n"
                f"spec:\n  model: {{source: demo}}\n  {extra}\n")
    done = c.kubectl("apply", "-f", "-", input=manifest, check=False)
    assert done.returncode != 0
    assert "is invalid" in done.stderr and message in done.stderr, done.stderr
    assert c.kubectl("get", "kvd", "bad", "-n", NAMESPACE, check=False).returncode != 0
