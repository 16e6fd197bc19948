# shellcheck shell=bash
# Configuration files of the one-node cluster's node components (sourced by scripts/cluster.sh,
# not run): containerd, the CNI network, the kubelet and kube-proxy. Every path they would
# otherwise write on the host (/var/lib/containerd, /run/containerd, /etc/cni, /opt/cni,
# /var/lib/kubelet, /var/log/pods, the NRI socket) is moved under DIR or RUN_DIR.

containerd_config() {
    mkdir -p "$DIR/containerd" "$RUN_DIR"
    cat >"$DIR/containerd/config.toml" <<EOF_CT
version = 3
root = '$DIR/containerd/root'
state = '$RUN_DIR/state'
imports = []

[grpc]
  address = '$RUN_DIR/containerd.sock'
[ttrpc]
  address = '$RUN_DIR/containerd.sock.ttrpc'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '$PAUSE_IMAGE'
  [plugins.'io.containerd.cri.v1.runtime']
    netns_mounts_under_state_dir = true
    # no process here may lower its oom_score_adj (root lacks CAP_SYS_RESOURCE in this sandbox):
    # runc would fail every sandbox ("failed to update /proc/self/oom_score_adj") for the -998 the
    # CRI asks; clamp pods to containerd's own score instead (what rootless containerd does)
    restrict_oom_score_adj = ${RESTRICT_OOM_SCORE_ADJ}
    cdi_spec_dirs = []
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '$RUNC_BIN/runc'
          Root = '$RUN_DIR/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['$CNI_BIN']
      conf_dir = '$DIR/cni/net.d'
  [plugins.'io.containerd.internal.v1.opt']
    path = '$DIR/containerd/opt'
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = '$RUN_DIR/s'
  [plugins.'io.containerd.image-verifier.v1.bindir']
    bin_dir = '$DIR/containerd/image-verifier'
EOF_CT
}

cni_config() {
    mkdir -p "$DIR/cni/net.d" "$DIR/cni/ipam"
    cat >"$DIR/cni/net.d/10-kvdrive.conflist" <<EOF_CNI
{
  "cniVersion": "1.0.0",
  "name": "kvdrive",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$DIR/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF_CNI
}

kubelet_config() {  # KUBELET_PORT HEALTHZ_PORT
    mkdir -p "$DIR/kubelet" "$DIR/logs/pods"
    cat >"$DIR/kubelet/config.yaml" <<EOF_KL
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# this host mounts cgroup v1 controllers one per hierarchy; Kubernetes 1.35 refuses v1 unless told
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$RUN_DIR/containerd.sock
address: $NODE_IP
port: $1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $2
# only the API server (its client certificate, signed by the cluster CA) talks to the kubelet
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: AlwaysAllow}
podLogsDir: $DIR/logs/pods
resolvConf: /etc/resolv.conf
failSwapOn: false
# the images come from no registry: never garbage-collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: 2%, imagefs.available: 2%}
maxPods: 40
serializeImagePulls: false
EOF_KL
}

kube_proxy_config() {  # HEALTHZ_PORT METRICS_PORT
    cat >"$DIR/kube-proxy.yaml" <<EOF_KP
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $DIR/kubeconfigs/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_CIDR
detectLocalMode: ClusterCIDR
healthzBindAddress: 127.0.0.1:$1
metricsBindAddress: 127.0.0.1:$2
oomScoreAdj: ${OOM_SCORE_ADJ}
# leave the host's conntrack sysctls as they are
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF_KP
}
