# shellcheck shell=bash
# Go builds shared by scripts/control-plane.sh and scripts/cluster.sh (sourced, not run).
#
#   kube_build BIN_DIR VERSION CMD...   build k8s.io/kubernetes/cmd/CMD... at VERSION into BIN_DIR
#   go_build_module BIN_DIR MODULE@VERSION PKG... [-- GO BUILD FLAGS...]
#                                       build main packages of a module that has no replace
#                                       directives (go install's rules) into BIN_DIR
#
# Kubernetes cannot be `go install`ed: its go.mod replaces its staging modules with ./staging/...
# So it is built from a throwaway wrapper module that requires k8s.io/kubernetes and replaces every
# staging module with its published v0.<minor>.<patch> release. Each binary is written as NAME.tmp
# and renamed when whole, so that an interrupted build never leaves a half-written binary cached.
# The calling scripts run with `set -e`: a failed step ends them.

log() { printf '[%s] %s\n' "${LOG_TAG:-build}" "$*" >&2; }

kube_build() {
    local bin_dir="$1" version="$2" work gomod staging minor patch cmd
    shift 2
    minor="$(cut -d. -f2 <<<"$version")"
    patch="$(cut -d. -f3 <<<"$version")"
    work="$(mktemp -d)"
    mkdir -p "$bin_dir"
    log "building $* v$version (Kubernetes from source) in $work"
    (
        cd "$work" || exit 1
        go mod init "kvdrive.local/kube-build" >/dev/null 2>&1
        gomod="$(go mod download -json "k8s.io/kubernetes@v$version" \
            | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
        [[ -f "$gomod" ]] || { log "could not download k8s.io/kubernetes@v$version"; exit 1; }
        # every `k8s.io/<m> => ./staging/src/k8s.io/<m>` line of Kubernetes' own go.mod
        staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$gomod")"
        [[ -n "$staging" ]] || { log "no staging replaces found in $gomod"; exit 1; }
        local args=(-require="k8s.io/kubernetes@v$version")
        for m in $staging; do
            args+=(-replace="$m=$m@v0.$minor.$patch")
        done
        go mod edit "${args[@]}"
        {
            printf '//go:build tools\n\npackage tools\n\nimport (\n'
            for cmd in "$@"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$cmd"; done
            printf ')\n'
        } >tools.go
        go mod tidy >/dev/null
        local pkg=k8s.io/component-base/version pkgs=()
        for cmd in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
        mkdir -p out
        # one go build for all commands: the packages they share are compiled once
        CGO_ENABLED=0 go build -trimpath -o out/ -ldflags "-s -w \
            -X $pkg.gitVersion=v$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor \
            -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
            "${pkgs[@]}"
        for cmd in "$@"; do
            mv "out/$cmd" "$bin_dir/$cmd.tmp" && mv "$bin_dir/$cmd.tmp" "$bin_dir/$cmd"
        done
    )
    rm -rf "$work"  # (a failed build exits the calling script, set -e, and leaves $work to read)
}

go_build_module() {
    local bin_dir="$1" modver="$2" work pkgs=() flags=()
    shift 2
    while (($#)) && [[ "$1" != "--" ]]; do pkgs+=("$1"); shift; done
    (($#)) && shift
    flags=("$@")
    work="$(mktemp -d)"
    mkdir -p "$bin_dir"
    log "building ${pkgs[*]##*/} from $modver in $work"
    (
        cd "$work" || exit 1
        go mod init "kvdrive.local/build" >/dev/null 2>&1
        go get "$modver" >/dev/null
        {
            printf '//go:build tools\n\npackage tools\n\nimport (\n'
            for p in "${pkgs[@]}"; do printf '\t_ "%s"\n' "$p"; done
            printf ')\n'
        } >tools.go
        go mod tidy >/dev/null
        mkdir -p out
        go build -trimpath -o out/ "${flags[@]}" "${pkgs[@]}"
        for p in "${pkgs[@]}"; do
            mv "out/${p##*/}" "$bin_dir/${p##*/}.tmp" && mv "$bin_dir/${p##*/}.tmp" "$bin_dir/${p##*/}"
        done
    )
    rm -rf "$work"  # (a failed build exits the calling script, set -e, and leaves $work to read)
}
