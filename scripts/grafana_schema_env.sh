#!/usr/bin/env bash
# Grafana's published dashboard schema (npm @grafana/schema) and the TypeScript compiler that
# checks a dashboard against it, for tests/unit/test_grafana_dashboard_schema.py; the same for CI
# and developers.
#
#   scripts/grafana_schema_env.sh   install if missing (idempotent; instant when installed)
#
# Installs the pinned versions below with npm (node and npm from PATH, the public npm registry or
# the one npm is configured with) into .tools/grafana-schema/ (git-ignored; DDILOCO_TOOLS_DIR
# moves it), npm's cache in .tools/npm-cache. Prints that directory (it holds node_modules) on
# stdout; progress and errors go to stderr; exits non-zero when it cannot provide both packages
# at the pinned versions (the test then fails: it never skips). Needs no root.
set -euo pipefail

GRAFANA_SCHEMA_VERSION=13.2.3
TYPESCRIPT_VERSION=5.9.3

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${DDILOCO_TOOLS_DIR:-$ROOT/.tools}"
DIR="$TOOLS/grafana-schema"

log() { printf '[grafana_schema_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

version_of() { node -p "require('$1/node_modules/$2/package.json').version" 2>/dev/null; }

installed() {
  [[ "$(version_of "$1" @grafana/schema)" == "$GRAFANA_SCHEMA_VERSION" ]] \
    && [[ "$(version_of "$1" typescript)" == "$TYPESCRIPT_VERSION" ]] \
    && [[ -f "$1/node_modules/@grafana/schema/dist/types/index.d.ts" ]] \
    && timeout 60 node "$1/node_modules/typescript/bin/tsc" --version >/dev/null 2>&1
}

command -v node >/dev/null || die "node is not on PATH (Debian: apt-get install nodejs npm)"
if ! installed "$DIR"; then
  command -v npm >/dev/null || die "npm is not on PATH (Debian: apt-get install npm)"
  mkdir -p "$TOOLS"
  # One installation at a time (two test sessions may start together).
  exec 9>"$TOOLS/.grafana-schema-env.lock"
  flock -w 600 9 || die "another grafana_schema_env.sh held $TOOLS/.grafana-schema-env.lock for 10 minutes"
  if ! installed "$DIR"; then
    work="$(mktemp -d "$TOOLS/.grafana-schema.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    echo '{"name": "ddiloco-grafana-schema", "private": true}' >"$work/package.json"
    log "npm install @grafana/schema@$GRAFANA_SCHEMA_VERSION typescript@$TYPESCRIPT_VERSION"
    (cd "$work" && timeout 600 npm install --no-audit --no-fund --ignore-scripts --save-exact \
        --cache "$TOOLS/npm-cache" \
        "@grafana/schema@$GRAFANA_SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION" >&2) \
      || die "npm install failed (is the npm registry reachable?)"
    installed "$work" || die "npm installed something, but not working @grafana/schema $GRAFANA_SCHEMA_VERSION and typescript $TYPESCRIPT_VERSION"
    rm -rf "$DIR"
    mv "$work" "$DIR"  # a reader sees the old directory, none, or the complete new one
    trap - EXIT
  fi
fi
log "@grafana/schema $(version_of "$DIR" @grafana/schema), typescript $(version_of "$DIR" typescript) ($DIR)"
echo "$DIR"
