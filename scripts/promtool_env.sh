#!/usr/bin/env bash
# promtool (Prometheus's checker) for the metrics and alerting-rules tests, the same for CI and
# developers.
#
#   scripts/promtool_env.sh     provide promtool if missing (idempotent; instant when provided)
#
# Uses `promtool` from PATH when there is one (Debian's `prometheus` package installed), else
# .tools/bin/promtool; when neither works, takes the binary out of Debian's `prometheus` package:
# `apt-get update`, `apt-get download prometheus` and `dpkg-deb` extract /usr/bin/promtool into
# .tools/bin. The package is never installed, so no Prometheus service is started, enabled or
# bound to a port on this machine (installing it would start one through its maintainer
# scripts). Prints promtool's path on stdout; progress and errors go to stderr; exits non-zero
# when it cannot provide a working promtool (the tests then fail: they never skip). Needs root
# for apt-get update, unless promtool is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DDILOCO_TOOLS_DIR:-$ROOT/.tools}/bin"

log() { printf '[promtool_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

works() { [[ -x "$1" ]] && timeout 60 "$1" --version >/dev/null 2>&1; }

find_promtool() {
  local on_path
  on_path="$(command -v promtool || true)"
  if [[ -n "$on_path" ]] && works "$on_path"; then echo "$on_path"; return 0; fi
  if works "$BIN/promtool"; then echo "$BIN/promtool"; return 0; fi
  return 1
}

if ! promtool="$(find_promtool)"; then
  [[ "$(id -u)" == 0 ]] || die "promtool is missing and fetching it needs root (apt-get update); or: apt-get install prometheus"
  command -v apt-get >/dev/null || die "promtool is missing and there is no apt-get: install Prometheus's promtool yourself"
  # One download at a time (two test sessions may start together); apt has its own lock too.
  exec 9>/tmp/ddiloco-promtool-env.lock
  flock -w 900 9 || die "another promtool_env.sh held /tmp/ddiloco-promtool-env.lock for 15 minutes"
  if ! promtool="$(find_promtool)"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # apt downloads as its sandbox user (_apt), which must be able to write the package here.
    chown _apt "$work" 2>/dev/null || chmod 777 "$work"
    export DEBIAN_FRONTEND=noninteractive
    log "apt-get update"
    timeout 300 apt-get update -q >&2 || die "apt-get update failed"
    log "downloading Debian's prometheus package (about 19 MB) for its promtool"
    (cd "$work" && timeout 900 apt-get download -q -o DPkg::Lock::Timeout=600 prometheus >&2) \
      || die "apt-get download prometheus failed"
    deb="$(ls "$work"/prometheus_*.deb 2>/dev/null | head -n 1)"
    [[ -n "$deb" ]] || die "apt-get download left no prometheus_*.deb"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" ./usr/bin/promtool \
      || die "$deb has no usr/bin/promtool"
    mkdir -p "$BIN"
    install -m 0755 "$work/usr/bin/promtool" "$BIN/promtool.tmp"
    mv -f "$BIN/promtool.tmp" "$BIN/promtool"  # atomic: a concurrent reader never sees half a binary
    promtool="$(find_promtool)" || die "$BIN/promtool was extracted but does not run"
  fi
fi
log "$("$promtool" --version 2>&1 | head -n 1) ($promtool)"
echo "$promtool"
