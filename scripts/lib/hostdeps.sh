# shellcheck shell=bash
# Debian packages the one-node cluster and the image build need on the host (sourced, not run).
#
#   need_packages PKG...   install the missing ones with apt-get (as root); fail with the list
#                          otherwise
need_packages() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null; then
        log "missing Debian packages: ${missing[*]} (install them, or run as root on Debian)"
        return 1
    fi
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
