#!/usr/bin/env bash
# Set up (idempotent) and start the whole cluster on this machine: `bash scripts/up.sh [strata up flags]`
# e.g. `bash scripts/up.sh --decode 2 --port 8080`. Ctrl-C stops everything.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ "${STRATA_SKIP_SETUP:-0}" = 1 ] || bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m services.cli up "$@"
