# shellcheck shell=bash
# Identities of the one-node cluster (sourced by scripts/cluster.sh, not run): a CA, the API
# server's serving certificate (for the node IP, the `kubernetes` Service's ClusterIP and its DNS
# names), the API server's client certificate towards the kubelet, the ServiceAccount signing key,
# and one bearer token per component, each a user that Kubernetes' bootstrap RBAC already knows
# (system:kube-scheduler, system:kube-controller-manager, system:kube-proxy, the node as
# system:node:<name> in system:nodes, an admin in system:masters).

_cert() {  # NAME CN ORG [SAN]: DIR/pki/NAME.{key,crt} signed by the CA
    local pki="$DIR/pki" name="$1" cn="$2" org="$3" san="${4:-}"
    openssl req -new -newkey rsa:2048 -nodes -keyout "$pki/$name.key" -out "$pki/$name.csr" \
        -subj "/CN=$cn${org:+/O=$org}" 2>/dev/null
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=digitalSignature,keyEncipherment"
        if [[ -n "$san" ]]; then echo "extendedKeyUsage=serverAuth"; echo "subjectAltName=$san"
        else echo "extendedKeyUsage=clientAuth"; fi
    } >"$pki/$name.ext"
    openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 365 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
    rm -f "$pki/$name.csr" "$pki/$name.ext"
}

pki_create() {  # once per DIR (a restarted `up` keeps the identities)
    local pki="$DIR/pki"
    [[ -f "$pki/done" ]] && return 0
    mkdir -p "$pki"
    chmod 700 "$pki"
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 365 \
        -subj "/CN=kvdrive-cluster-ca" 2>/dev/null
    _cert apiserver kube-apiserver "" "IP:$NODE_IP,IP:127.0.0.1,IP:$SERVICE_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
    _cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
    local user token
    : >"$DIR/tokens.csv"
    for user in admin kube-scheduler kube-controller-manager kube-proxy "node:$NODE_NAME"; do
        token="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
        case "$user" in
        admin) echo "$token,kvdrive-admin,kvdrive-admin,system:masters" ;;
        node:*) echo "$token,system:$user,system:$user,system:nodes" ;;
        *) echo "$token,system:$user,system:$user" ;;
        esac >>"$DIR/tokens.csv"
    done
    chmod 600 "$DIR/tokens.csv"
    touch "$pki/done"
}

_token_of() { awk -F, -v u="$1" '$2 == u { print $1 }' "$DIR/tokens.csv"; }

kubeconfigs_write() {  # API_URL: DIR/kubeconfig (admin) and one per component under DIR/kubeconfigs
    local url="$1" name user file
    mkdir -p "$DIR/kubeconfigs"
    for name in admin kube-scheduler kube-controller-manager kube-proxy kubelet; do
        case "$name" in
        admin) user=kvdrive-admin; file="$DIR/kubeconfig" ;;
        kubelet) user="system:node:$NODE_NAME"; file="$DIR/kubeconfigs/kubelet.kubeconfig" ;;
        *) user="system:$name"; file="$DIR/kubeconfigs/$name.kubeconfig" ;;
        esac
        cat >"$file" <<EOF_KC
apiVersion: v1
kind: Config
clusters:
- name: kvdrive
  cluster:
    server: $url
    certificate-authority: $DIR/pki/ca.crt
contexts:
- name: kvdrive
  context: {cluster: kvdrive, user: $name}
current-context: kvdrive
users:
- name: $name
  user: {token: $(_token_of "$user")}
EOF_KC
        chmod 600 "$file"
    done
}
