#!/usr/bin/env bash
# Demo: train all-MiniLM-L6-v2 with and without KHA in turns, compare, fold, export.
# `bash scripts/demo.sh --docs docs` also refreshes the demo page's pictures (docs/demo_*.png, docs/demo.md).
set -euo pipefail
KHA_EXTRAS="${KHA_EXTRAS:-demo}"  # only what the demo needs: no test tools
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$KHA_ROOT"
exec "$KHA_VENV/bin/kha-compile" demo "$@"
