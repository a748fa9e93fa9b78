#!/usr/bin/env bash
# Debian's headless Chromium for the dashboard's browser test, the same for CI and developers.
#
#   scripts/browser_env.sh      install if missing (idempotent; instant when already installed)
#
# Installs the Debian packages chromium and chromium-driver with apt-get when `chromium` is not
# on PATH, then checks that the browser starts (`chromium --version`). Prints the browser's
# path on stdout; progress and errors go to stderr; exits non-zero when it cannot provide a
# working browser (the test then fails: it never skips). Needs root for apt-get, unless
# chromium is already installed.
set -euo pipefail

log() { printf '[browser_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if ! command -v chromium >/dev/null; then
  [[ "$(id -u)" == 0 ]] || die "chromium is not installed and installing it needs root: apt-get install chromium chromium-driver"
  # One installation at a time (two test sessions may start together); apt has its own lock too.
  exec 9>/tmp/ddiloco-browser-env.lock
  flock -w 900 9 || die "another browser_env.sh held /tmp/ddiloco-browser-env.lock for 15 minutes"
  if ! command -v chromium >/dev/null; then
    log "installing chromium and chromium-driver (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -q >&2 || die "apt-get update failed"
    timeout 900 apt-get install -y -q -o DPkg::Lock::Timeout=600 chromium chromium-driver >&2 \
      || die "apt-get install chromium chromium-driver failed"
  fi
fi
browser="$(command -v chromium)" || die "chromium still not on PATH"
version="$(timeout 60 "$browser" --headless --no-sandbox --version 2>/dev/null)" || die "$browser does not start"
log "$version ($browser)"
echo "$browser"
