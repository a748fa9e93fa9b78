#!/usr/bin/env bash
# etcd (the coordination engine of syncer leader election, issue 23) for the tests, the same for
# CI and developers.
#
#   scripts/etcd_env.sh     provide an etcd server binary if missing (idempotent; instant when provided)
#
# Uses `etcd` from PATH when there is one (Debian's `etcd-server` installed), else .tools/bin/etcd;
# when neither works, takes the binary out of Debian's `etcd-server` package: `apt-get update`,
# `apt-get download etcd-server` and `dpkg-deb` extract /usr/bin/etcd into .tools/bin. The package
# is never installed, so no etcd service is started, enabled or bound to a port on this machine
# (its maintainer scripts would start one on 2379); each test starts its own etcd on free ports in
# a temporary directory and stops it by PID. Prints etcd's path on stdout; progress and errors go
# to stderr; exits non-zero when it cannot provide a working etcd (the tests then fail: they never
# skip). Needs root for apt-get update, unless etcd is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DDILOCO_TOOLS_DIR:-$ROOT/.tools}/bin"

log() { printf '[etcd_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

works() { [[ -x "$1" ]] && timeout 60 "$1" --version >/dev/null 2>&1; }

find_etcd() {
  local on_path
  on_path="$(command -v etcd || true)"
  if [[ -n "$on_path" ]] && works "$on_path"; then echo "$on_path"; return 0; fi
  if works "$BIN/etcd"; then echo "$BIN/etcd"; return 0; fi
  return 1
}

if ! etcd="$(find_etcd)"; then
  [[ "$(id -u)" == 0 ]] || die "etcd is missing and fetching it needs root (apt-get update); or: apt-get install etcd-server"
  command -v apt-get >/dev/null || die "etcd is missing and there is no apt-get: install etcd (3.4 or newer) yourself"
  # One download at a time (two test sessions may start together); apt has its own lock too.
  exec 9>/tmp/ddiloco-etcd-env.lock
  flock -w 900 9 || die "another etcd_env.sh held /tmp/ddiloco-etcd-env.lock for 15 minutes"
  if ! etcd="$(find_etcd)"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # apt downloads as its sandbox user (_apt), which must be able to write the package here.
    chown _apt "$work" 2>/dev/null || chmod 777 "$work"
    export DEBIAN_FRONTEND=noninteractive
    log "apt-get update"
    timeout 300 apt-get update -q >&2 || die "apt-get update failed"
    log "downloading Debian's etcd-server package for its etcd binary"
    (cd "$work" && timeout 900 apt-get download -q -o DPkg::Lock::Timeout=600 etcd-server >&2) \
      || die "apt-get download etcd-server failed"
    deb="$(ls "$work"/etcd-server_*.deb 2>/dev/null | head -n 1)"
    [[ -n "$deb" ]] || die "apt-get download left no etcd-server_*.deb"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" ./usr/bin/etcd || die "$deb has no usr/bin/etcd"
    mkdir -p "$BIN"
    install -m 0755 "$work/usr/bin/etcd" "$BIN/etcd.tmp"
    mv -f "$BIN/etcd.tmp" "$BIN/etcd"  # atomic: a concurrent reader never sees half a binary
    etcd="$(find_etcd)" || die "$BIN/etcd was extracted but does not run"
  fi
fi
log "$("$etcd" --version 2>&1 | head -n 1) ($etcd)"
echo "$etcd"
