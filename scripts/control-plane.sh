#!/usr/bin/env bash
# A real Kubernetes control plane as plain processes: etcd + kube-apiserver (the pair that
# controller-runtime's envtest runs) and kube-controller-manager with only its garbage collector and
# namespace controller. No Docker, no nodes: pods never run, and there is no StatefulSet controller.
#
#   scripts/control-plane.sh build        build (or reuse) the binaries; prints their folder
#   scripts/control-plane.sh up DIR       build if missing, start them with state under DIR,
#                                         wait for /readyz, write DIR/kubeconfig (cluster-admin)
#   scripts/control-plane.sh down DIR     stop them; removes nothing else
#
# The API server listens on 127.0.0.1 only, authorizes with RBAC, signs ServiceAccount tokens
# (TokenRequest works), and writes an audit log of every request to DIR/audit.log.
#
# Binaries are built from source with Go and cached outside the repository, keyed by version:
#   ${KVDRIVE_CP_CACHE:-$HOME/.cache/kvdrive/control-plane}/k8s-v<KUBE>-etcd-v<ETCD>/
# (scripts/lib/gobuild.sh: Kubernetes from a wrapper module, since its go.mod cannot be installed).
set -euo pipefail

KUBE_VERSION="${KVDRIVE_KUBE_VERSION:-1.35.4}"
ETCD_VERSION="${KVDRIVE_ETCD_VERSION:-3.6.16}"
CACHE_ROOT="${KVDRIVE_CP_CACHE:-$HOME/.cache/kvdrive/control-plane}"
BIN_DIR="$CACHE_ROOT/k8s-v$KUBE_VERSION-etcd-v$ETCD_VERSION"

LOG_TAG=control-plane
# shellcheck source=scripts/lib/gobuild.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/gobuild.sh"

build_etcd() {
    local work
    work="$(mktemp -d)"
    log "building etcd v$ETCD_VERSION in $work"
    (
        cd "$work"
        go mod init kvdrive.local/etcd-build >/dev/null 2>&1
        cat >main.go <<'EOF'
// etcd's server entry point, as etcd's own main package runs it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
        go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >/dev/null 2>&1
        go mod tidy >/dev/null
        CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/etcd.tmp" .
    )
    rm -rf "$work"
    mv "$BIN_DIR/etcd.tmp" "$BIN_DIR/etcd"
}

build() {
    mkdir -p "$BIN_DIR"
    local start=$SECONDS
    [[ -x "$BIN_DIR/etcd" ]] || build_etcd
    if [[ ! -x "$BIN_DIR/kube-apiserver" || ! -x "$BIN_DIR/kube-controller-manager" ]]; then
        kube_build "$BIN_DIR" "$KUBE_VERSION" kube-apiserver kube-controller-manager
    fi
    log "binaries ready in $BIN_DIR ($((SECONDS - start)) s)"
    echo "$BIN_DIR"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_ready() {
    local url="$1" token="$2" deadline=$((SECONDS + ${KVDRIVE_CP_TIMEOUT:-120}))
    until curl -fsk -H "Authorization: Bearer $token" "$url/readyz" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            log "kube-apiserver not ready at $url after ${KVDRIVE_CP_TIMEOUT:-120} s; see $DIR/kube-apiserver.log"
            return 1
        fi
        sleep 0.5
    done
}

up() {
    DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
    build >/dev/null
    if [[ -f "$DIR/kube-apiserver.pid" ]] && kill -0 "$(cat "$DIR/kube-apiserver.pid")" 2>/dev/null; then
        log "already running (pid $(cat "$DIR/kube-apiserver.pid")); kubeconfig: $DIR/kubeconfig"
        return 0
    fi
    mkdir -p "$DIR/etcd" "$DIR/certs"
    local etcd_port peer_port api_port token
    etcd_port="$(free_port)"
    peer_port="$(free_port)"
    api_port="$(free_port)"
    token="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    echo "$token,kvdrive-admin,kvdrive-admin,system:masters" >"$DIR/tokens.csv"
    chmod 600 "$DIR/tokens.csv"
    [[ -f "$DIR/certs/sa.key" ]] || openssl genrsa -out "$DIR/certs/sa.key" 2048 2>/dev/null
    openssl rsa -in "$DIR/certs/sa.key" -pubout -out "$DIR/certs/sa.pub" 2>/dev/null
    # every request, with who made it and the answer (no bodies): the RBAC and scale tests read it
    cat >"$DIR/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
EOF

    "$BIN_DIR/etcd" --data-dir "$DIR/etcd" --name kvdrive-test \
        --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "kvdrive-test=http://127.0.0.1:$peer_port" \
        --unsafe-no-fsync --log-level warn >"$DIR/etcd.log" 2>&1 &
    echo $! >"$DIR/etcd.pid"

    # kube-apiserver writes a self-signed serving cert into --cert-dir on first start
    "$BIN_DIR/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
        --cert-dir "$DIR/certs" \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$DIR/certs/sa.pub" \
        --service-account-signing-key-file "$DIR/certs/sa.key" \
        --service-cluster-ip-range 10.0.0.0/24 \
        --authorization-mode RBAC \
        --token-auth-file "$DIR/tokens.csv" \
        --disable-admission-plugins ServiceAccount \
        --allow-privileged=true \
        --audit-policy-file "$DIR/audit-policy.yaml" --audit-log-path "$DIR/audit.log" \
        --audit-log-mode blocking \
        >"$DIR/kube-apiserver.log" 2>&1 &
    echo $! >"$DIR/kube-apiserver.pid"

    local url="https://127.0.0.1:$api_port"
    if ! wait_ready "$url" "$token"; then
        down "$DIR"
        return 1
    fi
    cat >"$DIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kvdrive-test
  cluster:
    server: $url
    certificate-authority: $DIR/certs/apiserver.crt
contexts:
- name: kvdrive-test
  context: {cluster: kvdrive-test, user: kvdrive-admin}
current-context: kvdrive-test
users:
- name: kvdrive-admin
  user: {token: $token}
EOF
    chmod 600 "$DIR/kubeconfig"
    # only the garbage collector and the namespace controller: no StatefulSet controller (its pods
    # would never run without nodes), no token or node controllers
    "$BIN_DIR/kube-controller-manager" --kubeconfig "$DIR/kubeconfig" \
        --controllers garbagecollector,namespace --leader-elect=false \
        --use-service-account-credentials=false --secure-port 0 \
        >"$DIR/kube-controller-manager.log" 2>&1 &
    echo $! >"$DIR/kube-controller-manager.pid"
    log "ready at $url; KUBECONFIG=$DIR/kubeconfig"
}

down() {
    local dir="$1" name pid
    for name in kube-controller-manager kube-apiserver etcd; do
        [[ -f "$dir/$name.pid" ]] || continue
        pid="$(cat "$dir/$name.pid")"
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$dir/$name.pid"
    done
    log "stopped ($dir)"
}

case "${1:-}" in
build) build ;;
up) [[ -n "${2:-}" ]] || { echo "usage: $0 up DIR" >&2; exit 2; }; up "$2" ;;
down) [[ -n "${2:-}" ]] || { echo "usage: $0 down DIR" >&2; exit 2; }; down "$2" ;;
*) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
