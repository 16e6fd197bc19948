"""Scene 9, the end: `scripts/cluster.sh down` stops everything and leaves the host as `up` found
it: mounts, network interfaces, addresses, routes, iptables and nftables, the sysctls (hugepages
included), cgroups, the host paths the components would create, and no process left.
"""

from __future__ import annotations

import pytest
from clusterkit import Cluster, cluster_down, host_state


def test_down_leaves_the_host_as_it_was(cluster: Cluster) -> None:
    if not cluster.owned or cluster.host_before is None:
        pytest.skip("KVDRIVE_E2E_DIR: the cluster is yours, it stays up")
    done = cluster_down(cluster.dir)
    assert done.returncode == 0, done.stderr
    after = host_state()
    for key, before in cluster.host_before.items():
        assert after[key] == before, f"{key} differs after down: +{set(after[key]) - set(before)} -{set(before) - set(after[key])}"
