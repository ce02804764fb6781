# Sourced by the other scripts: create or reuse .venv at the repo root and install the project.
#
#   KHA_EXTRAS=test source scripts/_venv.sh     # extras to install (default: test)
#
# torch is installed first and pinned, from PyTorch's CPU wheel index (KHA_TORCH_INDEX; empty: skip it) where
# that index answers within a few seconds, else from the package registry (with pip's configured indexes:
# CI's registry serves the CPU build; PyPI's Linux torch is the multi-GB CUDA build). Every
# other package is held at the version in constraints.txt (what the suite was last run with;
# refresh it with `bash scripts/lock.sh`). A stamp in .venv records the hash of pyproject.toml and
# constraints.txt and the extras installed; when the hashes match and the extras asked for are
# among those installed, nothing is installed again, so reruns are fast.

KHA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KHA_EXTRAS="${KHA_EXTRAS:-test}"
KHA_TORCH="${KHA_TORCH:-torch==2.13.0}"
KHA_TORCH_INDEX="${KHA_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
KHA_VENV="${KHA_VENV:-$KHA_ROOT/.venv}"  # overridable for the set-up test
KHA_STAMP="$KHA_VENV/.kha-install-stamp"

if [ ! -x "$KHA_VENV/bin/python" ]; then
    echo "Creating $KHA_VENV" >&2
    python3 -m venv "$KHA_VENV"
fi

_kha_hash="$( (cat "$KHA_ROOT/pyproject.toml" "$KHA_ROOT/constraints.txt"; echo "torch=$KHA_TORCH $KHA_TORCH_INDEX") | sha256sum | cut -d' ' -f1)"
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
    if [ -n "$KHA_TORCH_INDEX" ]; then
        # torch alone (its dependencies come next, from the registry); a short timeout and no retries, so an
        # index this machine cannot reach costs seconds, not pip's minutes of retries
        "${_kha_pip[@]}" install --no-compile --no-deps --index-url "$KHA_TORCH_INDEX" --timeout 5 --retries 0 "$KHA_TORCH" ||
            echo "note: $KHA_TORCH_INDEX did not answer; $KHA_TORCH comes from the package registry" >&2
    fi
    "${_kha_pip[@]}" install --no-compile -c "$KHA_ROOT/constraints.txt" "$KHA_TORCH"  # (its dependencies, or torch itself)
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
