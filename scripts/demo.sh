#!/usr/bin/env bash
# Demo: apply KHA to an embedded default model, train a few steps, fold, export.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$KHA_ROOT"
exec "$KHA_VENV/bin/kha-compile" demo "$@"
