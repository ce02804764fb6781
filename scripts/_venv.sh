# Sourced by the other scripts: create or reuse .venv at the repo root and install the project.
#
#   KHA_EXTRAS=test source scripts/_venv.sh     # extras to install (default: test)
#
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build. Every
# other package is held at the version in constraints.txt (what the suite was last run with;
# refresh it with `bash scripts/lock.sh`). A stamp in .venv records the hash of pyproject.toml and
# constraints.txt and the extras installed; when the hashes match and the extras asked for are
# among those installed, nothing is installed again, so reruns are fast.

KHA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KHA_EXTRAS="${KHA_EXTRAS:-test}"
KHA_TORCH="${KHA_TORCH:-torch==2.13.0}"
KHA_VENV="${KHA_VENV:-$KHA_ROOT/.venv}"  # overridable for the set-up test
KHA_STAMP="$KHA_VENV/.kha-install-stamp"

if [ ! -x "$KHA_VENV/bin/python" ]; then
    echo "Creating $KHA_VENV" >&2
    python3 -m venv "$KHA_VENV"
fi

_kha_hash="$( (cat "$KHA_ROOT/pyproject.toml" "$KHA_ROOT/constraints.txt"; echo "torch=$KHA_TORCH") | sha256sum | cut -d' ' -f1)"
_kha_have="$(cat "$KHA_STAMP" 2>/dev/null || true)"  # no stamp yet: a fresh venv (safe under set -e)
_kha_need=0
if [ "${_kha_have%% *}" != "$_kha_hash" ]; then
    _kha_need=1
    _kha_have_extras=""
else
    _kha_have_extras=" ${_kha_have#* } "
    for _kha_x in ${KHA_EXTRAS//,/ }; do
        case "$_kha_have_extras" in *" $_kha_x "*) ;; *) _kha_need=1 ;; esac
    done
fi
if [ "$_kha_need" = 1 ]; then
    echo "Installing $KHA_TORCH and kha-compile[$KHA_EXTRAS] into $KHA_VENV" >&2
    # --no-compile: pip would byte-compile every module of every package (transformers alone: 8 CPU-s, over a
    # minute on a busy machine); Python compiles, once, only what is imported, and caches it the same way
    _kha_pip=("$KHA_VENV/bin/python" -m pip --disable-pip-version-check -q)
    "${_kha_pip[@]}" install --no-compile -c "$KHA_ROOT/constraints.txt" "$KHA_TORCH"
    "${_kha_pip[@]}" install --no-compile -c "$KHA_ROOT/constraints.txt" -e "$KHA_ROOT[$KHA_EXTRAS]"
    # timm (the timm sweep) goes in without its dependencies: it requires torchvision, which pip would take
    # from the registry and which does not load beside the CPU torch (transformers breaks too); its other
    # requirements are in the extras. If it cannot install, the set-up goes on and the timm tests skip.
    case " ${KHA_EXTRAS//,/ } " in
    *" test "* | *" sweep "* | *" dev "*)
        "${_kha_pip[@]}" install --no-compile --no-deps -c "$KHA_ROOT/constraints.txt" timm ||
            echo "warning: timm did not install (pip install --no-deps timm); the timm sweep tests will skip" >&2
        ;;
    esac
    _kha_all="$(echo $_kha_have_extras ${KHA_EXTRAS//,/ } | tr ' ' '\n' | sort -u | tr '\n' ' ')"
    echo "$_kha_hash ${_kha_all% }" > "$KHA_STAMP"
fi
unset _kha_hash _kha_have _kha_need _kha_have_extras _kha_x _kha_pip _kha_all
