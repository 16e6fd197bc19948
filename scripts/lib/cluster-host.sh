# shellcheck shell=bash
# The host changes the one-node cluster makes, recorded before and undone after (sourced by
# scripts/cluster.sh, not run).
#
# `up` records into DIR/host/ what it will touch: the sysctls below (the kubelet and kube-proxy
# write some of them, up writes hugepages, ip_forward and bridge netfilter), both iptables
# dumps, whether the hugetlb cgroup hierarchy was mounted, and which of the host paths below
# existed. `down` puts every one back: it flushes the tables the cluster wrote, restores the
# dumps, writes the sysctls back, unmounts what it mounted (everything under DIR, the hugetlb
# hierarchy), deletes the bridge, the cgroups the kubelet made and the paths that did not exist.

HOST_SYSCTLS=(
    vm.nr_hugepages net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
    net.ipv4.conf.all.route_localnet vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
    kernel.keys.root_maxkeys kernel.keys.root_maxbytes
)
# paths the kubelet, containerd or the CNI plugins create outside DIR whatever they are told
HOST_PATHS=(/var/lib/cni /var/log/containers /var/log/pods /var/run/netns /run/containerd /etc/cni /opt/cni
    /var/lib/kubelet /run/nri /var/run/nri)
IPTABLES_TABLES=(filter nat mangle raw)
CGROUP_V1=/sys/fs/cgroup
HUGETLB_CGROUP="$CGROUP_V1/hugetlb"

host_record() {  # DIR: write DIR/host/* unless already recorded (up after a failed up keeps the first)
    local host="$1/host" key path
    [[ -f "$host/recorded" ]] && return 0
    mkdir -p "$host"
    : >"$host/sysctl"
    for key in "${HOST_SYSCTLS[@]}"; do
        [[ -e "/proc/sys/${key//.//}" ]] && echo "$key=$(cat "/proc/sys/${key//.//}")" >>"$host/sysctl"
    done
    iptables-save >"$host/iptables"
    nft list tables >"$host/nft-tables"
    ip6tables-save >"$host/ip6tables" 2>/dev/null || :
    : >"$host/absent-paths"
    for path in "${HOST_PATHS[@]}"; do [[ -e "$path" ]] || echo "$path" >>"$host/absent-paths"; done
    mountpoint -q "$HUGETLB_CGROUP" && echo yes >"$host/hugetlb-mounted" || echo no >"$host/hugetlb-mounted"
    [[ -d "$HUGETLB_CGROUP" ]] && echo yes >"$host/hugetlb-dir" || echo no >"$host/hugetlb-dir"
    touch "$host/recorded"
}

host_prepare() {  # DIR HUGEPAGES: the kernel settings the node needs
    local dir="$1" pages="$2" got
    if ! mountpoint -q "$HUGETLB_CGROUP" && grep -q '^hugetlb' /proc/cgroups \
        && ! grep -q 'cgroup2 /sys/fs/cgroup cgroup2' /proc/mounts; then
        mkdir -p "$HUGETLB_CGROUP"
        mount -t cgroup -o hugetlb cgroup "$HUGETLB_CGROUP"  # the kubelet limits pods' hugepages here
    fi
    sysctl -qw net.ipv4.ip_forward=1
    sysctl -qw net.bridge.bridge-nf-call-iptables=1 || log "warning: no bridge netfilter (br_netfilter)"
    sysctl -qw net.bridge.bridge-nf-call-ip6tables=1 || :
    if (($(cat /proc/sys/vm/nr_hugepages) < pages)); then
        sysctl -qw vm.nr_hugepages="$pages"
    fi
    got="$(cat /proc/sys/vm/nr_hugepages)"
    ((got >= pages)) || log "warning: asked for $pages 2Mi hugepages, the kernel reserved $got"
    log "hugepages: $got x 2Mi reserved for the node"
}

_flush_iptables() {  # CMD: empty every chain of the tables the cluster writes
    local cmd="$1" table
    for table in "${IPTABLES_TABLES[@]}"; do
        "$cmd" -t "$table" -F 2>/dev/null || continue
        "$cmd" -t "$table" -X 2>/dev/null || :
    done
    for chain in INPUT FORWARD OUTPUT; do "$cmd" -t filter -P "$chain" ACCEPT 2>/dev/null || :; done
}

host_restore() {  # DIR: undo host_prepare and whatever the cluster's processes changed
    local dir="$1" host="$1/host" line path mnt
    [[ -f "$host/recorded" ]] || return 0
    # every mount under DIR and the runtime folder (pods' volumes, containers' root file systems,
    # network namespaces), deepest first
    while read -r mnt; do
        umount -l "$mnt" 2>/dev/null || :
    done < <(awk -v d="$dir/" -v r="$RUN_DIR/" '{ m = $5; gsub(/\\040/, " ", m); if (index(m, d) == 1 || index(m, r) == 1) print m }' \
        /proc/self/mountinfo | sort -r)
    ip link del "$BRIDGE" 2>/dev/null || :
    _flush_iptables iptables
    _flush_iptables ip6tables
    # iptables-nft leaves the tables it made, empty: drop the ones that did not exist before
    local table
    while IFS= read -r table; do
        # shellcheck disable=SC2086 # "table FAMILY NAME": three words for nft
        grep -qxF "$table" "$host/nft-tables" || nft delete $table 2>/dev/null || :
    done < <(nft list tables)
    iptables-restore <"$host/iptables"
    ip6tables-restore <"$host/ip6tables" 2>/dev/null || :
    while IFS= read -r line; do
        sysctl -qw "$line" 2>/dev/null || log "warning: could not restore $line"
    done <"$host/sysctl"
    # the cgroups the kubelet made (kubepods and its children), in every v1 hierarchy
    local hier
    for hier in "$CGROUP_V1"/*/ "$CGROUP_V1"/unified/; do
        [[ -d "$hier/kubepods" ]] || continue
        find "$hier/kubepods" -depth -type d -exec rmdir {} \; 2>/dev/null || log "warning: cgroups left in $hier/kubepods"
    done
    if [[ "$(cat "$host/hugetlb-mounted")" == no ]] && mountpoint -q "$HUGETLB_CGROUP"; then
        umount "$HUGETLB_CGROUP" || log "warning: $HUGETLB_CGROUP is still mounted"
    fi
    [[ "$(cat "$host/hugetlb-dir")" == no && -d "$HUGETLB_CGROUP" ]] && rmdir "$HUGETLB_CGROUP" 2>/dev/null || :
    while IFS= read -r path; do
        [[ -n "$path" && -e "$path" ]] && rm -rf "$path"
    done <"$host/absent-paths"
    rm -rf "$RUN_DIR"
    rm -rf "$host"
}
