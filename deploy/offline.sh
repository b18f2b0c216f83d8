#!/usr/bin/env bash
# Air-gapped image builds and a throw-away Docker engine, for `make image-offline` / `make test-deploy`.
# Nothing here pulls from an image registry: the bases are Debian bookworm trees made by mmdebstrap
# and `docker import`ed; Python packages come from a wheelhouse filled on the host by `pip download`.
# Network steps (apt, mmdebstrap, pip) retry and fail loudly with their reason.
#
#   deploy/offline.sh tools          install docker.io, docker-compose, mmdebstrap where absent (apt)
#   deploy/offline.sh wheelhouse     fill $CACHE/wheelhouse (torch: the CPU wheel from $TORCH_WHEEL_DIR)
#   deploy/offline.sh bases          $CACHE/debian-{python,redis,prometheus}.tar (mmdebstrap)
#   deploy/offline.sh images         import the bases, build $MSERVE_IMAGE from the wheelhouse, print sizes
#   deploy/offline.sh engine-start   start dockerd (vfs, own data root and socket) unless an engine answers
#   deploy/offline.sh engine-stop    stop the dockerd engine-start started and remove its data root
#   deploy/offline.sh test           all of it, then tests/deploy/test_compose.py (`make test-deploy`)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${MSERVE_DEPLOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mserve-deploy}  # outside the build context
WHEELHOUSE=deploy/wheelhouse               # inside the build context; only its README.md is committed
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0+cpu}  # a local label: never PyPI's CUDA build of the same version
SUITE=${DEBIAN_SUITE:-bookworm}            # its python3 is 3.11, the wheelhouse's ABI
BASE_IMAGE=${OFFLINE_BASE_IMAGE:-mserve-base:$SUITE}
REDIS_IMAGE=${REDIS_IMAGE:-mserve-redis:$SUITE}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-mserve-prometheus:$SUITE}  # the compose `monitoring` profile's
MSERVE_IMAGE=${MSERVE_IMAGE:-mserve:offline}
ENGINE_DIR=${MSERVE_ENGINE_DIR:-/var/tmp/mserve-dockerd}
NICE=(nice -n "${BUILD_NICE:-15}")

say() { echo "deploy: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }

retry() {  # retry N CMD...: the network is flaky; after N tries the last error stands
  local n=$1 i; shift
  for ((i = 1; i <= n; i++)); do
    "$@" && return 0
    say "try $i/$n failed: $*"
    ((i < n)) && sleep $((5 * i))
  done
  return 1
}

timed() {  # timed LABEL CMD...: run, print the wall time
  local label=$1 t0=$SECONDS; shift
  "$@"
  echo "deploy: $label took $((SECONDS - t0)) s" >&2
}

cmd_tools() {
  local need=()
  command -v docker >/dev/null || need+=(docker.io)
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || need+=(docker-compose)
  command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
  ((${#need[@]})) || return 0
  [ "$(id -u)" = 0 ] || die "need root to install ${need[*]} (apt-get)"
  say "installing ${need[*]}"
  retry 3 apt-get update -q || die "apt-get update failed (Debian mirror unreachable?)"
  retry 3 env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" \
    || die "apt-get install ${need[*]} failed"
}

project_deps() {  # pyproject's dependencies, without building the project
  python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    | sed 's/;.*//; s/ //g'
}

cmd_wheelhouse() {
  local torch
  torch=$(ls "$TORCH_WHEEL_DIR"/torch-*+cpu-cp311-*.whl 2>/dev/null | head -n1) \
    || die "no CPU torch wheel for cp311 in $TORCH_WHEEL_DIR (set TORCH_WHEEL_DIR)"
  mkdir -p "$WHEELHOUSE"
  cp -n "$torch" "$WHEELHOUSE/"
  # The image's Python is Debian's 3.11 on x86_64: ask for exactly those wheels, whatever the host runs.
  # async-timeout: redis-py needs it below Python 3.11.3. setuptools: building mserve itself, offline.
  retry 3 "${NICE[@]}" python3 -m pip download -q --dest "$WHEELHOUSE" --find-links "$WHEELHOUSE" \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
    "$TORCH_PIN" "async-timeout" "setuptools>=68" $(project_deps) \
    || die "pip download into $WHEELHOUSE failed (PyPI unreachable?)"
  rm -f "$WHEELHOUSE"/mserve-*  # the project is built from the context, never from a stale wheel
  ls "$WHEELHOUSE"/torch-*+cpu-* >/dev/null || die "the wheelhouse holds no CPU torch"
  if ls "$WHEELHOUSE"/nvidia_* >/dev/null 2>&1; then die "CUDA packages in $WHEELHOUSE: a CUDA torch got in"; fi
  say "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
}

debootstrap_tar() {  # debootstrap_tar OUT PACKAGES [MMDEBSTRAP ARGS...]: a minbase tree as a tarball, cached
  local out=$1 pkgs=$2; shift 2
  [ -s "$out" ] && return 0
  mkdir -p "$CACHE"
  retry 3 "${NICE[@]}" mmdebstrap --quiet --variant=minbase --include="$pkgs" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='APT::Install-Recommends "false"' "$@" \
    "$SUITE" "${out%.tar}.part.tar" || die "mmdebstrap $SUITE failed (Debian mirror unreachable?)"
  mv "${out%.tar}.part.tar" "$out"  # mmdebstrap picks its output format from the name: keep .tar last
}

cmd_bases() {
  timed "debian python base" debootstrap_tar "$CACHE/debian-python.tar" python3,python3-venv,ca-certificates
  timed "debian redis base" debootstrap_tar "$CACHE/debian-redis.tar" redis-server
  # Debian's Prometheus (and promtool, its health check); /prometheus holds its data, as in the upstream image.
  timed "debian prometheus base" debootstrap_tar "$CACHE/debian-prometheus.tar" prometheus \
    --customize-hook='mkdir -p "$1/prometheus"'
}

cmd_images() {
  [ -s "$CACHE/debian-python.tar" ] && [ -s "$CACHE/debian-redis.tar" ] && [ -s "$CACHE/debian-prometheus.tar" ] \
    || cmd_bases
  ls "$WHEELHOUSE"/torch-*.whl >/dev/null 2>&1 || cmd_wheelhouse
  docker info >/dev/null 2>&1 || die "no Docker engine answers (${DOCKER_HOST:-default socket}); run engine-start"
  timed "import $BASE_IMAGE" docker import "$CACHE/debian-python.tar" "$BASE_IMAGE" >/dev/null
  timed "import $REDIS_IMAGE" docker import -c 'EXPOSE 6379' \
    -c 'CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no"]' \
    "$CACHE/debian-redis.tar" "$REDIS_IMAGE" >/dev/null
  timed "import $PROMETHEUS_IMAGE" docker import -c 'EXPOSE 9090' -c 'ENTRYPOINT ["/usr/bin/prometheus"]' \
    "$CACHE/debian-prometheus.tar" "$PROMETHEUS_IMAGE" >/dev/null
  timed "build $MSERVE_IMAGE" "${NICE[@]}" docker build -q -f deploy/Dockerfile \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELHOUSE="$WHEELHOUSE" -t "$MSERVE_IMAGE" . >/dev/null
  docker run --rm "$MSERVE_IMAGE" --help >/dev/null || die "$MSERVE_IMAGE does not run 'mserve --help'"
  docker image ls --format 'deploy: image {{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "$MSERVE_IMAGE|$REDIS_IMAGE|$PROMETHEUS_IMAGE|$BASE_IMAGE" >&2 || true
}

cmd_engine_start() {
  if docker info >/dev/null 2>&1; then say "an engine answers at ${DOCKER_HOST:-the default socket}; using it"; return 0; fi
  command -v dockerd >/dev/null || die "no dockerd (run: deploy/offline.sh tools)"
  [ "$(id -u)" = 0 ] || die "starting dockerd needs root"
  if [ -d "$ENGINE_DIR" ]; then  # an earlier run's, whose cleanup did not finish
    local old
    old=$(cat "$ENGINE_DIR/dockerd.pid" 2>/dev/null || true)
    [ -n "$old" ] && kill -0 "$old" 2>/dev/null && die "a dockerd an earlier run started still runs (pid $old, \
$ENGINE_DIR); stop it with: MSERVE_ENGINE_DIR=$ENGINE_DIR deploy/offline.sh engine-stop"
    remove_engine_dir || die "$ENGINE_DIR is left from an earlier run and cannot be removed (above)"
    say "removed $ENGINE_DIR, left by an earlier run"
  fi
  mkdir -p "$ENGINE_DIR/root"
  ip link show docker0 >/dev/null 2>&1 || touch "$ENGINE_DIR/made-docker0"  # engine-stop removes the bridge it made
  local sock="unix://$ENGINE_DIR/docker.sock"
  # vfs: overlayfs is not available inside every VM/container this runs in; it copies layers, so images
  # are kept to few layers. Its own socket, data root, bridge and pid file: nothing of an existing setup
  # is touched, and engine-stop knows exactly what to stop.
  dockerd --storage-driver=vfs --data-root "$ENGINE_DIR/root" --exec-root "$ENGINE_DIR/exec" \
    --pidfile "$ENGINE_DIR/dockerd.pid" -H "$sock" >"$ENGINE_DIR/dockerd.log" 2>&1 &
  echo $! >"$ENGINE_DIR/started.pid"
  local i
  for ((i = 0; i < 60; i++)); do
    DOCKER_HOST=$sock docker info >/dev/null 2>&1 && { echo "$sock"; return 0; }
    kill -0 "$(cat "$ENGINE_DIR/started.pid")" 2>/dev/null || break
    sleep 1
  done
  tail -n 20 "$ENGINE_DIR/dockerd.log" >&2
  die "dockerd did not start (log above, $ENGINE_DIR/dockerd.log)"
}

engine_mounts() {  # the mount points at or below $ENGINE_DIR, deepest first (a child sorts after its parent)
  awk -v d="$ENGINE_DIR" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

remove_engine_dir() {  # unmount what dockerd left under $ENGINE_DIR, then remove it; 0 when it is gone
  local i m left
  # dockerd leaves mounts behind when it is killed, and sometimes when it is not: its exec root, the
  # data root bind-mounted onto itself (to make it private), a container's shm. Unmount every one, deepest
  # first, lazily where a plain umount finds it busy, until none is left; then the folder can go.
  for ((i = 0; i < 10; i++)); do
    left=$(engine_mounts)
    [ -z "$left" ] && break
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done <<<"$left"
  done
  [ -f "$ENGINE_DIR/made-docker0" ] && { ip link delete docker0 2>/dev/null || true; }
  rm -rf "$ENGINE_DIR" 2>/dev/null && return 0
  say "WARNING: could not remove $ENGINE_DIR; mounts still under it:"
  engine_mounts | sed 's/^/deploy:   /' >&2
  return 1
}

cmd_engine_stop() {  # never fails: a cleanup problem is reported, it does not replace the test's verdict
  [ -f "$ENGINE_DIR/started.pid" ] || return 0
  local pid i
  pid=$(cat "$ENGINE_DIR/started.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd ($pid) ignored TERM for 60 s; killing it"; kill -KILL "$pid" || true; }
  fi
  remove_engine_dir && say "stopped dockerd ($pid) and removed $ENGINE_DIR"
  return 0
}

cmd_test() {  # the compose test with real containers: an engine (started if none answers), the images, pytest
  local py=${PYTHON:-.venv/bin/python} t0=$SECONDS sock rc=0
  cmd_tools
  sock=$(cmd_engine_start) || { cmd_engine_stop; exit 1; }  # its reason is printed already
  if [ -n "$sock" ]; then
    export DOCKER_HOST=$sock
    trap cmd_engine_stop EXIT
    trap 'exit 143' TERM INT  # a time box (CI's timeout) still stops the engine: through the EXIT trap
  fi
  timed "images (bases, wheelhouse, build)" cmd_images
  MSERVE_DEPLOY_TESTS=1 MSERVE_IMAGE=$MSERVE_IMAGE REDIS_IMAGE=$REDIS_IMAGE PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE timeout "${DEPLOY_TEST_TIMEOUT:-1800}" \
    "$py" -m pytest -q -s -p no:cacheprovider tests/deploy/test_compose.py || rc=$?
  [ "$rc" -eq 5 ] && say "pytest collected no tests"
  say "test-deploy: $([ "$rc" -eq 0 ] && echo passed || echo "FAILED ($rc)") in $((SECONDS - t0)) s"
  return "$rc"
}

[ $# -gt 0 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
for step in "$@"; do
  case "$step" in
    tools) cmd_tools ;;
    wheelhouse) cmd_wheelhouse ;;
    bases) cmd_bases ;;
    images) cmd_images ;;
    engine-start) cmd_engine_start ;;
    engine-stop) cmd_engine_stop ;;
    test) cmd_test ;;
    *) sed -n '2,13p' "$0" >&2; exit 2 ;;
  esac
done
