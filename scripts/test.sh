#!/usr/bin/env bash
# Set up (idempotent), lint, and run the whole test suite: `bash scripts/test.sh [pytest args]`.
# Fails on lint errors, on any test failure, and when no test ran (pytest exit code 5).
# Env: STRATA_TEST_TIMEOUT (per-test seconds, default 300), STRATA_SUITE_TIMEOUT (whole suite,
#      default 2400), STRATA_TEST_THREADS (torch threads in tests, default 1),
#      STRATA_SKIP_SETUP=1 (skip scripts/setup.sh when you know it is done).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ "${STRATA_SKIP_SETUP:-0}" = 1 ] || bash "$ROOT/scripts/setup.sh" --compose
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
log() { if [ -t 2 ]; then printf '\033[1m[test]\033[0m %s\n' "$*" >&2; else printf '[test] %s\n' "$*" >&2; fi; }

log "ruff check"
"$PY" -m ruff check .
log "ruff format --check"
"$PY" -m ruff format --check .

log "pytest (per-test timeout ${STRATA_TEST_TIMEOUT:-300}s)"
export STRATA_TEST_THREADS="${STRATA_TEST_THREADS:-1}"
start=$(date +%s)
set +e
timeout --signal=INT --kill-after=60 "${STRATA_SUITE_TIMEOUT:-2400}" \
  "$PY" -m pytest -q -p no:cacheprovider --timeout="${STRATA_TEST_TIMEOUT:-300}" \
  --durations=40 "$@"
rc=$?
set -e
log "pytest finished in $(( $(date +%s) - start ))s with exit code $rc"
case $rc in
  0) log "all tests passed" ;;
  5) log "FAILED: no tests were collected"; exit 5 ;;
  124|130) log "FAILED: the suite ran past ${STRATA_SUITE_TIMEOUT:-2400}s"; exit 1 ;;
  *) log "FAILED"; exit "$rc" ;;
esac
