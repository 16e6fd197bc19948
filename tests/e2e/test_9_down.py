"""Scene 9, the end: `scripts/cluster.sh down` stops everything and leaves the host as `up` found
it: mounts, network interfaces, addresses, routes, iptables and nftables, the sysctls (hugepages
included), cgroups, the host paths the components would create, and no process left: the Valkey
shards of the pods' shared tier included (nothing listens on the pods' network), their files removed.
"""

from __future__ import annotations

import pytest
from clusterkit import Cluster, cluster_down, cluster_processes, host_state


def test_down_leaves_the_host_as_it_was(cluster: Cluster) -> None:
    if not cluster.owned or cluster.host_before is None:
        pytest.skip("KVDRIVE_E2E_DIR: the cluster is yours, it stays up")
    listening = host_state()["pod network listeners"]
    assert len(listening) == 6, listening  # 3 Valkey shards and their cluster bus ports, until down
    running = {name.split()[1] for name in cluster_processes(cluster.dir)}
    assert {"etcd", "kube-apiserver", "kube-controller", "kubelet", "containerd"} <= running, running
    done = cluster_down(cluster.dir)
    assert done.returncode == 0, done.stderr
    after = host_state()
    assert cluster_processes(cluster.dir) == []
    assert not (cluster.dir / "valkey").exists(), "down removes the Valkey shards' folder"
    for key, before in cluster.host_before.items():
        assert after[key] == before, f"{key} differs after down: +{set(after[key]) - set(before)} -{set(before) - set(after[key])}"
