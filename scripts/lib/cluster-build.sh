# shellcheck shell=bash
# Builds of the one-node cluster's binaries (sourced by scripts/cluster.sh, not run).
#
# Everything is built from source with Go and cached outside the repository, one folder per
# component keyed by its version, under ${KVDRIVE_CLUSTER_CACHE:-$HOME/.cache/kvdrive/cluster}:
#   kubernetes-v<K>/    kubelet kube-scheduler kube-proxy kubectl (Kubernetes' wrapper-module build)
#   containerd-v<C>/    containerd containerd-shim-runc-v2 ctr
#   runc-v<R>/          runc (cgo, libseccomp)
#   cni-plugins-v<P>/   bridge host-local loopback portmap
#   helm-v<H>/          helm
#   crictl-v<T>/        crictl (cri-tools: `down` stops the pods through the CRI, as the kubelet would)
#   pause-<hash>/       pause (scripts/pause, the pods' sandbox container), keyed by its source
# The control plane (etcd, kube-apiserver, kube-controller-manager) comes from
# scripts/control-plane.sh's cache.

KUBE_VERSION="${KVDRIVE_KUBE_VERSION:-1.35.4}"
CONTAINERD_VERSION="${KVDRIVE_CONTAINERD_VERSION:-2.4.2}"
RUNC_VERSION="${KVDRIVE_RUNC_VERSION:-1.5.3}"
CNI_VERSION="${KVDRIVE_CNI_VERSION:-1.10.0}"
HELM_VERSION="${KVDRIVE_HELM_VERSION:-4.3.2}"
CRICTL_VERSION="${KVDRIVE_CRICTL_VERSION:-1.37.0}"
CLUSTER_CACHE="${KVDRIVE_CLUSTER_CACHE:-$HOME/.cache/kvdrive/cluster}"
KUBE_BIN="$CLUSTER_CACHE/kubernetes-v$KUBE_VERSION"
CONTAINERD_BIN="$CLUSTER_CACHE/containerd-v$CONTAINERD_VERSION"
RUNC_BIN="$CLUSTER_CACHE/runc-v$RUNC_VERSION"
CNI_BIN="$CLUSTER_CACHE/cni-plugins-v$CNI_VERSION"
HELM_BIN="$CLUSTER_CACHE/helm-v$HELM_VERSION"
CRICTL_BIN="$CLUSTER_CACHE/crictl-v$CRICTL_VERSION"
PAUSE_SRC="$SCRIPTS/pause/main.go"
PAUSE_BIN="$CLUSTER_CACHE/pause-$(sha256sum "$PAUSE_SRC" | cut -c1-12)"
CNI_PLUGINS=(bridge host-local loopback portmap)

have_all() {
    local dir="$1" f
    shift
    for f in "$@"; do [[ -x "$dir/$f" ]] || return 1; done
}

build_node() {
    local start=$SECONDS
    need_packages iptables nftables conntrack libseccomp-dev pkg-config gcc
    CP_BIN="$(bash "$SCRIPTS/control-plane.sh" build)"  # etcd, kube-apiserver, kube-controller-manager
    export CP_BIN
    have_all "$KUBE_BIN" kubelet kube-scheduler kube-proxy kubectl \
        || kube_build "$KUBE_BIN" "$KUBE_VERSION" kubelet kube-scheduler kube-proxy kubectl
    have_all "$CONTAINERD_BIN" containerd containerd-shim-runc-v2 ctr \
        || CGO_ENABLED=0 go_build_module "$CONTAINERD_BIN" "github.com/containerd/containerd/v2@v$CONTAINERD_VERSION" \
            github.com/containerd/containerd/v2/cmd/containerd \
            github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
            github.com/containerd/containerd/v2/cmd/ctr \
            -- -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w \
            -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION"
    have_all "$RUNC_BIN" runc \
        || CGO_ENABLED=1 go_build_module "$RUNC_BIN" "github.com/opencontainers/runc@v$RUNC_VERSION" \
            github.com/opencontainers/runc \
            -- -tags "seccomp urfave_cli_no_docs" -ldflags "-s -w -X main.version=$RUNC_VERSION"
    have_all "$CNI_BIN" "${CNI_PLUGINS[@]}" \
        || CGO_ENABLED=0 go_build_module "$CNI_BIN" "github.com/containernetworking/plugins@v$CNI_VERSION" \
            github.com/containernetworking/plugins/plugins/main/bridge \
            github.com/containernetworking/plugins/plugins/ipam/host-local \
            github.com/containernetworking/plugins/plugins/main/loopback \
            github.com/containernetworking/plugins/plugins/meta/portmap \
            -- -ldflags "-s -w \
            -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=v$CNI_VERSION"
    have_all "$HELM_BIN" helm \
        || CGO_ENABLED=0 go_build_module "$HELM_BIN" "helm.sh/helm/v4@v$HELM_VERSION" helm.sh/helm/v4/cmd/helm \
            -- -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=v$HELM_VERSION"
    have_all "$CRICTL_BIN" crictl \
        || CGO_ENABLED=0 go_build_module "$CRICTL_BIN" "sigs.k8s.io/cri-tools@v$CRICTL_VERSION" \
            sigs.k8s.io/cri-tools/cmd/crictl \
            -- -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v$CRICTL_VERSION"
    if ! have_all "$PAUSE_BIN" pause; then
        log "building pause from $PAUSE_SRC"
        mkdir -p "$PAUSE_BIN"
        (cd "$(dirname "$PAUSE_SRC")" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
            -o "$PAUSE_BIN/pause.tmp" main.go)
        mv "$PAUSE_BIN/pause.tmp" "$PAUSE_BIN/pause"
    fi
    log "node binaries ready under $CLUSTER_CACHE ($((SECONDS - start)) s)"
}
