#!/usr/bin/env bash
# Test suite (pytest-xdist on 2 cores). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$KHA_ROOT"
exec "$KHA_VENV/bin/python" -m pytest -n 2 tests "$@"
