#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine or a cached one: `bash scripts/setup.sh [--compose]`
#   always: .venv (python >= 3.11) with the project installed editable, MinIO built into
#     .cache/bin/minio when none is found, the default model in the cache (all that `strata up`
#     runs: scripts/up.sh calls it this way);
#   --compose (scripts/test.sh): also the test and bench extras, and (as root) Docker,
#     debootstrap, Docker Compose and the images of the live compose test, helm with the MinIO
#     chart for tests/compose/test_helm.py, kustomize and npm's KEDA validators for
#     tests/compose/test_k8s_autoscale.py.
# Needs no network beyond the package registries (PyPI, the Go module proxy, npm, Debian).
# Env: STRATA_PYTHON (interpreter to use), STRATA_CACHE (cache dir, default .cache),
#      PIP_CACHE_DIR (default $STRATA_CACHE/pip), STRATA_MINIO_BIN (an existing minio binary),
#      STRATA_SKIP_MODEL=1 (do not build the default model), STRATA_SKIP_COMPOSE=1 (with
#      --compose: no Docker, helm only).
set -euo pipefail

COMPOSE=0
for arg in "$@"; do
  case "$arg" in
    --compose) COMPOSE=1 ;;
    *) echo "[setup] unknown argument $arg (usage: scripts/setup.sh [--compose])" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${STRATA_CACHE:-$ROOT/.cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
mkdir -p "$CACHE/bin" "$PIP_CACHE_DIR"

log() { if [ -t 2 ]; then printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; else printf '[setup] %s\n' "$*" >&2; fi; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  log "apt-get install $*"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

# ---- 1. virtual environment -------------------------------------------------------------------
if [ ! -x "$PY" ] || ! py_ok "$PY"; then
  BASE="${STRATA_PYTHON:-}"
  if [ -z "$BASE" ]; then
    for cand in python3.13 python3.12 python3.11 python3; do
      if command -v "$cand" >/dev/null && py_ok "$(command -v "$cand")"; then BASE="$(command -v "$cand")"; break; fi
    done
  fi
  if [ -z "$BASE" ]; then
    apt_install python3 python3-venv python3-pip || true
    if command -v python3 >/dev/null && py_ok "$(command -v python3)"; then BASE="$(command -v python3)"; fi
  fi
  [ -n "$BASE" ] || { log "need python >= 3.11 (set STRATA_PYTHON)"; exit 1; }
  log "creating .venv with $BASE ($("$BASE" --version))"
  rm -rf "$VENV"
  if ! "$BASE" -m venv "$VENV"; then
    apt_install python3-venv && "$BASE" -m venv "$VENV"
  fi
fi

# ---- 1b. iproute2 (`ip netns`) for the multi-host tests, with --compose and root --------------
if [ "$COMPOSE" = 1 ] && ! command -v ip >/dev/null && [ "$(id -u)" = 0 ]; then
  apt_install iproute2 || log "no iproute2: tests/multihost will skip"
fi

# ---- 2. the project and its dependencies ------------------------------------------------------
# Skip pip entirely when pyproject.toml is unchanged since the last successful install; otherwise
# pip keeps what is already satisfied (torch from PyPI is a multi-GB build: never reinstalled).
# The first run (scripts/up.sh) installs what `strata up` runs; --compose (scripts/test.sh) adds
# the test and bench extras. The stamp names the extras, so a full install satisfies both.
STAMP="$VENV/.strata-installed"
HASH="$(sha256sum pyproject.toml | cut -d' ' -f1)"
# (A stamp of the hash alone is an older set-up's full install.)
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$COMPOSE" = 1 ]; then SPEC=".[test,bench]"; else SPEC="."; fi
case "$HAVE" in
  "$HASH" | "$HASH .[test,bench]") FRESH=1 ;;
  "$HASH .") FRESH=$((1 - COMPOSE)) ;;
  *) FRESH=0 ;;
esac
if [ "$FRESH" = 0 ] || ! "$PY" -c 'import services, torch, nats' 2>/dev/null; then
  log "installing the project: pip install -e $SPEC (pip cache: $PIP_CACHE_DIR)"
  "$PY" -m pip install --progress-bar on -e "$SPEC"
  echo "$HASH $SPEC" > "$STAMP"
else
  log "python packages up to date"
fi

# ---- 2b. the native CPU kernels: one library per ISA variant (docs/ENGINE.md) ----------------
# Cached by source hash + flags: a no-op once built. Without a compiler the engine runs torch.
# The kernels are called as torch custom ops: one C++ library per torch version (c++ and torch's
# headers), built here too.
if ! STRATA_CACHE="$CACHE" "$PY" -m shared.model.build_kernels; then
  log "native CPU kernels not built (is cc installed?): the engine will use torch on CPU"
elif ! STRATA_CACHE="$CACHE" "$PY" -m shared.model.torch_ops; then
  log "the kernels' torch ops not built (is c++ installed?): the engine will use torch on CPU"
fi

# ---- 3. MinIO (the SSD tier) ------------------------------------------------------------------
# Pinned: the module version of MinIO's 2026-02-12 commit (MinIO tags are not semver, so Go names
# it by pseudo-version). Change it deliberately, never to @latest: an upstream change would break
# set-up on every fresh machine.
MINIO_VERSION="v0.0.0-20260212201848-7aac2a2c5b7c"
MINIO=""
for cand in "${STRATA_MINIO_BIN:-}" "$(command -v minio || true)" "$CACHE/bin/minio"; do
  if [ -n "$cand" ] && [ -x "$cand" ]; then MINIO="$cand"; break; fi
done
find_go() {
  GO="$(command -v go || true)"
  if [ -z "$GO" ] && [ -x /usr/local/go/bin/go ]; then GO=/usr/local/go/bin/go; fi
  if [ -z "$GO" ] && apt_install golang-go; then GO="$(command -v go || true)"; fi
  [ -n "$GO" ]
}
if [ -z "$MINIO" ]; then
  if ! find_go; then log "MinIO not found and Go cannot be installed; set STRATA_MINIO_BIN"; exit 1; fi
  log "building MinIO: go install github.com/minio/minio@$MINIO_VERSION (first time only: about 5 minutes on 2 cores)"
  # GOTOOLCHAIN=auto lets an older Debian Go fetch the toolchain MinIO needs from the module proxy.
  GOBIN="$CACHE/bin" GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" \
    GOTOOLCHAIN=auto GOFLAGS=-modcacherw "$GO" install -v "github.com/minio/minio@$MINIO_VERSION" 2>&1 \
    | awk '/^go: downloading/ { d++; if (d % 50 == 0) { printf "[setup] minio build: %d modules downloaded\n", d; fflush() }; next }
           /^go: / { print "[setup] " $0; fflush(); next }
           { n++; if (n % 50 == 0) { printf "[setup] minio build: %d packages compiled (%s)\n", n, $0; fflush() } }'
  [ -x "$CACHE/bin/minio" ] || { log "MinIO build failed"; exit 1; }
  MINIO="$CACHE/bin/minio"
fi
log "minio: $MINIO"

# ---- 3b. Docker for the live compose test (tests/compose/test_compose_live.py) ---------------
# The test runs compose/docker-compose.yml under a dockerd of its own (Debian's docker.io, as
# root), on images built here once from a debootstrap base (debootstrap) and kept in
# $CACHE/docker; Docker Compose v2 is built from its pinned Go module (Debian's docker-compose 1.x
# lacks what the compose file uses: configs with content, !reset in the test's override).
# STRATA_SKIP_COMPOSE=1 skips this section (the live compose test then fails and says why).
COMPOSE_VERSION="2.40.3"  # also tests/compose/docker_env.py
if [ "$COMPOSE" = 0 ]; then
  log "no Docker, Compose images or helm (the first run needs none; scripts/setup.sh --compose adds them)"
elif [ "${STRATA_SKIP_COMPOSE:-0}" = 1 ]; then
  log "STRATA_SKIP_COMPOSE=1: no Docker set-up (tests/compose/test_compose_live.py will fail)"
elif [ "$(id -u)" != 0 ]; then
  log "not root: no Docker set-up (tests/compose/test_compose_live.py needs root and will fail)"
else
  missing=""
  command -v dockerd >/dev/null || missing="$missing docker.io"
  command -v debootstrap >/dev/null || missing="$missing debootstrap"
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    apt_install --no-install-recommends $missing || { log "cannot install$missing"; exit 1; }
  fi
  COMPOSE_BIN="$CACHE/bin/docker-compose"
  if [ "$("$COMPOSE_BIN" version --short 2>/dev/null)" != "$COMPOSE_VERSION" ]; then
    if ! find_go; then log "Docker Compose not built and Go cannot be installed"; exit 1; fi
    log "building Docker Compose v$COMPOSE_VERSION from its Go module (first time only: 3-6 minutes on 2 cores)"
    # Not `go install module@version`: compose's go.mod has exclude directives, which go install
    # refuses; so the module's source is downloaded and built as the main module, in a copy.
    export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" \
      GOTOOLCHAIN=auto GOFLAGS=-modcacherw CGO_ENABLED=0
    SRC="$("$GO" mod download -json "github.com/docker/compose/v2@v$COMPOSE_VERSION" \
      | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
    BUILD="$(mktemp -d)"
    cp -r "$SRC" "$BUILD/src" && chmod -R u+w "$BUILD/src"
    (cd "$BUILD/src" && "$GO" build -trimpath -o "$COMPOSE_BIN" \
      -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=v$COMPOSE_VERSION" ./cmd) \
      || { rm -rf "$BUILD"; log "Docker Compose build failed"; exit 1; }
    rm -rf "$BUILD"
    unset GOPATH GOMODCACHE GOCACHE GOTOOLCHAIN GOFLAGS CGO_ENABLED
  fi
  log "docker compose: $COMPOSE_BIN ($("$COMPOSE_BIN" version --short))"
  # The images (base, wheels, strata, NATS, MinIO): about 5 minutes the first time, seconds after.
  "$PY" -m tests.compose.docker_env prepare || { log "compose images could not be built"; exit 1; }
fi

# ---- 3c. Helm and the MinIO chart (tests/compose/test_helm.py) -------------------------------
# The test renders the upstream MinIO chart with compose/k8s/helm/minio-values.yaml. The chart
# ships in MinIO's own Go module (folder helm/minio of the MINIO_VERSION above), so it comes from
# the module cache; helm is built from its pinned Go module. Both only need the Go module proxy.
HELM_VERSION="v3.22.0"  # also tests/compose/test_helm.py
export_go_env() {
  export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" \
    GOTOOLCHAIN=auto GOFLAGS=-modcacherw CGO_ENABLED=0
}
if [ "$COMPOSE" = 1 ]; then
  if [ "$("$CACHE/bin/helm" version --short 2>/dev/null)" != "$HELM_VERSION" ]; then
    if ! find_go; then log "helm not built and Go cannot be installed"; exit 1; fi
    log "building helm $HELM_VERSION from its Go module (first time only: 3-5 minutes on 2 cores)"
    (export_go_env && GOBIN="$CACHE/bin" "$GO" install \
      -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
      "helm.sh/helm/v3/cmd/helm@$HELM_VERSION") || { log "helm build failed"; exit 1; }
  fi
  if [ ! -f "$CACHE/go/mod/github.com/minio/minio@$MINIO_VERSION/helm/minio/Chart.yaml" ]; then
    if ! find_go; then log "the MinIO chart is missing and Go cannot be installed"; exit 1; fi
    log "downloading the MinIO module (its helm/minio chart) into the Go module cache"
    (export_go_env && "$GO" mod download "github.com/minio/minio@$MINIO_VERSION") \
      || { log "MinIO module download failed"; exit 1; }
  fi
  log "helm: $CACHE/bin/helm ($HELM_VERSION), MinIO chart in the Go module cache"
fi

# ---- 3d. kustomize and KEDA's ScaledObject validators (tests/compose/test_k8s_autoscale.py) ---
# The test builds compose/k8s and the compose/k8s-autoscale overlays with the kustomize that
# kubectl 1.33 embeds (built from its Go module), and checks the KEDA ScaledObjects with the
# validators npm's @kubernetes-models/keda compiles from KEDA's API schema.
KUSTOMIZE_VERSION="v5.6.0"  # also tests/compose/test_k8s_autoscale.py
KEDA_MODELS_VERSION="2.0.0"  # also tests/compose/test_k8s_autoscale.py
if [ "$COMPOSE" = 1 ]; then
  if [ "$("$CACHE/bin/kustomize" version 2>/dev/null)" != "$KUSTOMIZE_VERSION" ]; then
    if ! find_go; then log "kustomize not built and Go cannot be installed"; exit 1; fi
    log "building kustomize $KUSTOMIZE_VERSION from its Go module"
    (export_go_env && GOBIN="$CACHE/bin" "$GO" install \
      -ldflags "-s -w -X sigs.k8s.io/kustomize/api/provenance.version=$KUSTOMIZE_VERSION" \
      "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION") || { log "kustomize build failed"; exit 1; }
  fi
  KEDA_DIR="$CACHE/node/keda"
  KEDA_PKG="$KEDA_DIR/node_modules/@kubernetes-models/keda/package.json"
  if [ "$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' "$KEDA_PKG" 2>/dev/null)" != "$KEDA_MODELS_VERSION" ]; then
    command -v npm >/dev/null || apt_install nodejs npm || { log "npm cannot be installed"; exit 1; }
    log "installing @kubernetes-models/keda@$KEDA_MODELS_VERSION (npm) into $KEDA_DIR"
    mkdir -p "$KEDA_DIR"
    npm install --prefix "$KEDA_DIR" --no-save --no-audit --no-fund --loglevel=error \
      "@kubernetes-models/keda@$KEDA_MODELS_VERSION" >/dev/null || { log "npm install failed"; exit 1; }
  fi
  log "kustomize: $CACHE/bin/kustomize ($KUSTOMIZE_VERSION), KEDA validators in $KEDA_DIR"
fi

# ---- 4. the built-in default model ------------------------------------------------------------
if [ "${STRATA_SKIP_MODEL:-0}" != 1 ]; then
  if "$PY" -c 'import shared.model.default_model' 2>/dev/null; then
    log "default model: $("$PY" -m services.cli model build-default)"
  else
    log "shared.model.default_model is not available yet; skipping the default model"
  fi
fi
log "ready"
