# Sourced by the other scripts: create or reuse .venv at the repo root and install the project.
#
#   KHA_EXTRAS=test source scripts/_venv.sh     # extras to install (default: test)
#
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# A stamp in .venv records the pyproject.toml hash and the extras; when they match, nothing is
# installed again, so reruns are fast.

KHA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KHA_EXTRAS="${KHA_EXTRAS:-test}"
KHA_TORCH="${KHA_TORCH:-torch==2.13.0}"
KHA_VENV="$KHA_ROOT/.venv"
KHA_STAMP="$KHA_VENV/.kha-install-stamp"

if [ ! -x "$KHA_VENV/bin/python" ]; then
    echo "Creating $KHA_VENV" >&2
    python3 -m venv "$KHA_VENV"
fi

_kha_want="$( (cat "$KHA_ROOT/pyproject.toml"; echo "extras=$KHA_EXTRAS torch=$KHA_TORCH") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$KHA_STAMP" 2>/dev/null)" != "$_kha_want" ]; then
    echo "Installing $KHA_TORCH and kha-compile[$KHA_EXTRAS] into $KHA_VENV" >&2
    _kha_pip=("$KHA_VENV/bin/python" -m pip --disable-pip-version-check -q)
    "${_kha_pip[@]}" install "$KHA_TORCH"
    "${_kha_pip[@]}" install -e "$KHA_ROOT[$KHA_EXTRAS]"
    echo "$_kha_want" > "$KHA_STAMP"
fi
unset _kha_want _kha_pip
