#!/usr/bin/env bash
# Refresh constraints.txt: the exact versions the set-up commands install (scripts/_venv.sh passes
# it to pip with -c). Resolves kha-compile[test] afresh in a throwaway venv, with the pinned torch
# installed first, and writes what pip chose. Run it, then run `bash scripts/test.sh`, and commit
# both the new constraints.txt and whatever the new versions needed.
#
#   bash scripts/lock.sh            # rewrites constraints.txt at the repository root
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_pin="${KHA_TORCH:-torch==2.13.0}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "$torch_pin"
"${pip[@]}" install -e "$root[test]"
"${pip[@]}" install --no-deps timm  # as scripts/_venv.sh: timm's torchvision does not load beside the CPU torch
{
    echo "# Versions the set-up commands install (pip -c). Tested with bash scripts/test.sh."
    echo "# Refresh: bash scripts/lock.sh (resolves kha-compile[test] afresh), then run the tests."
    echo "# Written $(date -u +%Y-%m-%d) by scripts/lock.sh with $("$tmp/venv/bin/python" -V)."
    # local version labels (+cpu) dropped: "torch==2.13.0" matches the CPU wheel on disk
    "$tmp/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check | sed -E 's/\+[a-z0-9.]+$//' | sort -f
} > "$root/constraints.txt"
echo "wrote $root/constraints.txt ($(grep -vc '^#' "$root/constraints.txt") pins)" >&2
