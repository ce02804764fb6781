#!/usr/bin/env bash
# The documentation site (MkDocs + Material, the API reference by mkdocstrings), from docs/ and mkdocs.yml.
#
#   bash scripts/docs.sh                # build it, strictly, into site/ (open site/index.html)
#   bash scripts/docs.sh serve          # serve it at http://127.0.0.1:8000, rebuilt on every change
#   bash scripts/docs.sh build -d DIR   # other mkdocs arguments go to mkdocs
#
# Creates or reuses .venv like the other scripts (scripts/_venv.sh), with kha-compile[docs].
set -euo pipefail
KHA_EXTRAS="${KHA_EXTRAS:-docs}"
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$KHA_ROOT"
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, printed on every build
if [ "$#" -eq 0 ]; then
    set -- build --strict
fi
exec "$KHA_VENV/bin/mkdocs" "$@"
