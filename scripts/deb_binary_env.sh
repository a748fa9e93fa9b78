#!/usr/bin/env bash
# One binary out of a Debian package, for the tests: the same for CI and developers.
#
#   scripts/deb_binary_env.sh NAME PACKAGE [HINT]
#       provide the program NAME (idempotent; instant when provided)
#
# Uses NAME from PATH when there is one (PACKAGE installed), else .tools/bin/NAME; when neither
# works, takes the binary out of Debian's PACKAGE: `apt-get update`, `apt-get download PACKAGE` and
# `dpkg-deb` extract /usr/bin/NAME into .tools/bin. The package is never installed, so no service of
# it is started, enabled or bound to a port on this machine (its maintainer scripts would start
# one). Prints the binary's path on stdout; progress and errors go to stderr; exits non-zero when
# it cannot provide a working binary (the tests then fail: they never skip). Needs root for
# apt-get update, unless the binary is already there. HINT: what to install by hand without apt.
# The thin wrappers etcd_env.sh and promtool_env.sh name the binaries the tests use.
set -euo pipefail

[[ $# -ge 2 ]] || { echo "usage: $0 NAME PACKAGE [HINT]" >&2; exit 2; }
NAME="$1"
PACKAGE="$2"
HINT="${3:-$PACKAGE}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DDILOCO_TOOLS_DIR:-$ROOT/.tools}/bin"

log() { printf '[%s_env] %s\n' "$NAME" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

works() { [[ -x "$1" ]] && timeout 60 "$1" --version >/dev/null 2>&1; }

find_binary() {
  local on_path
  on_path="$(command -v "$NAME" || true)"
  if [[ -n "$on_path" ]] && works "$on_path"; then echo "$on_path"; return 0; fi
  if works "$BIN/$NAME"; then echo "$BIN/$NAME"; return 0; fi
  return 1
}

if ! binary="$(find_binary)"; then
  [[ "$(id -u)" == 0 ]] || die "$NAME is missing and fetching it needs root (apt-get update); or: apt-get install $PACKAGE"
  command -v apt-get >/dev/null || die "$NAME is missing and there is no apt-get: install $HINT yourself"
  # One download at a time (two test sessions may start together); apt has its own lock too.
  exec 9>"/tmp/ddiloco-$NAME-env.lock"
  flock -w 900 9 || die "another $NAME download held /tmp/ddiloco-$NAME-env.lock for 15 minutes"
  if ! binary="$(find_binary)"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # apt downloads as its sandbox user (_apt), which must be able to write the package here.
    chown _apt "$work" 2>/dev/null || chmod 777 "$work"
    export DEBIAN_FRONTEND=noninteractive
    log "apt-get update"
    timeout 300 apt-get update -q >&2 || die "apt-get update failed"
    log "downloading Debian's $PACKAGE package for its $NAME"
    (cd "$work" && timeout 900 apt-get download -q -o DPkg::Lock::Timeout=600 "$PACKAGE" >&2) \
      || die "apt-get download $PACKAGE failed"
    deb="$(ls "$work"/"${PACKAGE}"_*.deb 2>/dev/null | head -n 1)"
    [[ -n "$deb" ]] || die "apt-get download left no ${PACKAGE}_*.deb"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" "./usr/bin/$NAME" || die "$deb has no usr/bin/$NAME"
    mkdir -p "$BIN"
    install -m 0755 "$work/usr/bin/$NAME" "$BIN/$NAME.tmp"
    mv -f "$BIN/$NAME.tmp" "$BIN/$NAME"  # atomic: a concurrent reader never sees half a binary
    binary="$(find_binary)" || die "$BIN/$NAME was extracted but does not run"
  fi
fi
log "$("$binary" --version 2>&1 | head -n 1) ($binary)"
echo "$binary"
