# Sourced by the other scripts: create or reuse .venv at the repo root and install the project.
#
#   KHA_EXTRAS=test source scripts/_venv.sh     # extras to install (default: test)
#
# Two parts. The dependencies (torch and every package the extras name) go into one environment per set of
# requirements, outside the clone and shared by every clone: ~/.cache/kha_compile/deps-<hash> (KHA_CACHE), built
# under a lock by the first clone that needs it. .venv at the repo root is a thin venv that sees that
# environment's packages (a .pth file) and holds kha_compile itself, installed editable, and the console
# scripts (pytest, ruff, mypy, mkdocs, ...) run by .venv's python. A second clone then starts in seconds, and
# what the first one compiled is reused: Python's bytecode, and Inductor's C++ kernels, whose cache key holds
# the include path of torch (a torch at another path compiles every kernel again). KHA_SHARED_DEPS=0 installs
# everything into .venv instead (nothing outside the clone).
#
# torch is installed first and pinned, from PyTorch's CPU wheel index (KHA_TORCH_INDEX; empty: skip it) where
# that index answers within a few seconds, else from the package registry (with pip's configured indexes:
# CI's registry serves the CPU build; PyPI's Linux torch is the multi-GB CUDA build). Every
# other package is held at the version in constraints.txt (what the suite was last run with;
# refresh it with `bash scripts/lock.sh`). The shared environment records the requirements installed into it,
# .venv's stamp which shared environment it uses (KHA_SHARED_DEPS=0: the hash of pyproject.toml and
# constraints.txt and the extras installed); a rerun with nothing new installs nothing.

KHA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KHA_EXTRAS="${KHA_EXTRAS:-test}"
KHA_TORCH="${KHA_TORCH:-torch==2.13.0}"
KHA_TORCH_INDEX="${KHA_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
KHA_VENV="${KHA_VENV:-$KHA_ROOT/.venv}"  # overridable for the set-up test
KHA_STAMP="$KHA_VENV/.kha-install-stamp"
KHA_CACHE="${KHA_CACHE:-$HOME/.cache/kha_compile}"

# _kha_has_extras STAMP_LINE EXTRAS: the stamp's hash is $_kha_hash and it lists every extra of EXTRAS
_kha_has_extras() {
    local have="$1" x
    [ "${have%% *}" = "$_kha_hash" ] || return 1
    for x in ${2//,/ }; do
        case " ${have#* } " in *" $x "*) ;; *) return 1 ;; esac
    done
}

# _kha_stamp FILE EXTRAS: record $_kha_hash and the union of the extras FILE listed and EXTRAS
_kha_stamp() {
    local have extras
    have="$(cat "$1" 2>/dev/null || true)"
    [ "${have%% *}" = "$_kha_hash" ] && extras="${have#* }" || extras=""
    extras="$(echo $extras ${2//,/ } | tr ' ' '\n' | sort -u | tr '\n' ' ')"
    echo "$_kha_hash ${extras% }" > "$1"
}

# _kha_install PYTHON EXTRAS WHAT...: torch, then WHAT (pip arguments), then timm, into PYTHON's environment
_kha_install() {
    local python="$1" extras="$2"
    shift 2
    # --no-compile: pip would byte-compile every module of every package (transformers alone: 8 CPU-s, over a
    # minute on a busy machine); Python compiles, once, only what is imported, and caches it the same way
    local pip=("$python" -m pip --disable-pip-version-check -q)
    if [ -n "$KHA_TORCH_INDEX" ]; then
        # torch alone (its dependencies come next, from the registry); a short timeout and no retries, so an
        # index this machine cannot reach costs seconds, not pip's minutes of retries
        "${pip[@]}" install --no-compile --no-deps --index-url "$KHA_TORCH_INDEX" --timeout 5 --retries 0 "$KHA_TORCH" ||
            echo "note: $KHA_TORCH_INDEX did not answer; $KHA_TORCH comes from the package registry" >&2
    fi
    "${pip[@]}" install --no-compile -c "$KHA_ROOT/constraints.txt" "$KHA_TORCH"  # (its dependencies, or torch itself)
    "${pip[@]}" install --no-compile -c "$KHA_ROOT/constraints.txt" "$@"
    # timm (the timm sweep) goes in without its dependencies: it requires torchvision, which pip would take
    # from the registry and which does not load beside the CPU torch (transformers breaks too); its other
    # requirements are in the extras. If it cannot install, the set-up goes on and the timm tests skip.
    case " ${extras//,/ } " in
    *" test "* | *" sweep "* | *" dev "*)
        "${pip[@]}" install --no-compile --no-deps -c "$KHA_ROOT/constraints.txt" timm ||
            echo "warning: timm did not install (pip install --no-deps timm); the timm sweep tests will skip" >&2
        ;;
    esac
}

# The requirements of kha-compile[EXTRAS] ("*": every extra), its own extras expanded (pyproject.toml read with tomllib); fails
# where python3 has no tomllib (< 3.11): the set-up then installs into .venv alone.
_kha_requirements() {
    python3 - "$KHA_ROOT/pyproject.toml" "$1" <<'EOF'
import re, sys, tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
todo = list(extras) if sys.argv[2] == "*" else [x for x in sys.argv[2].split(",") if x]
out, seen = list(project["dependencies"]), set()
while todo:
    extra = todo.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for req in extras[extra]:
        own = re.fullmatch(r"kha-compile\[([^\]]+)\]", req.replace(" ", ""))
        if own:
            todo.extend(own.group(1).split(","))
        elif req not in out:
            out.append(req)
print("\n".join(out))
EOF
}

# _kha_link_scripts: the shared environment's console scripts (pip too) in .venv/bin, run by .venv's python, or
# linked (programs: ruff)
_kha_link_scripts() {
    local bin name
    for bin in "$KHA_DEPS"/bin/*; do
        name="${bin##*/}"
        case "$name" in python* | activate* | Activate*) continue ;; esac
        rm -f "$KHA_VENV/bin/$name"  # (one made for an earlier shared environment)
        if head -n 1 "$bin" | grep -q "^#!$KHA_DEPS/bin/python"; then
            { echo "#!$KHA_VENV/bin/python"; tail -n +2 "$bin"; } > "$KHA_VENV/bin/$name"
            chmod +x "$KHA_VENV/bin/$name"
        else
            ln -s "$bin" "$KHA_VENV/bin/$name"
        fi
    done
}

if [ "${KHA_SHARED_DEPS:-1}" != "0" ] && _kha_all_reqs="$(_kha_requirements "$KHA_EXTRAS" 2>/dev/null)"; then
    # the shared environment of these requirements: its name is the hash of every extra's requirements (so one
    # environment serves the demo, the docs and the tests), constraints.txt and torch; it records the
    # requirements installed into it (.kha-requirements), and what a clone asks for beyond them is added
    _kha_hash="$( (_kha_requirements "*"; cat "$KHA_ROOT/constraints.txt"; echo "torch=$KHA_TORCH $KHA_TORCH_INDEX") |
        sha256sum | cut -c1-16)"
    KHA_DEPS="$KHA_CACHE/deps-$_kha_hash"
    case " ${KHA_EXTRAS//,/ } " in *" test "* | *" sweep "* | *" dev "*) _kha_all_reqs+=$'\ntimm' ;; esac
    _kha_missing() {  # the requirements asked for that the shared environment does not record
        comm -23 <(printf '%s\n' "$_kha_all_reqs" | sort -u) <(sort -u "$KHA_DEPS/.kha-requirements" 2>/dev/null || true)
    }
    _kha_relink=0
    if [ -n "$(_kha_missing)" ]; then
        _kha_relink=1  # (new console scripts, perhaps)
        mkdir -p "$KHA_CACHE"
        (
            flock 9  # one clone builds it; another waits, then finds it built
            if [ -n "$(_kha_missing)" ]; then
                echo "Installing the dependencies of kha-compile[$KHA_EXTRAS] into $KHA_DEPS (shared by every clone)" >&2
                [ -x "$KHA_DEPS/bin/python" ] || python3 -m venv "$KHA_DEPS"
                mapfile -t _kha_reqs < <(printf '%s\n' "$_kha_all_reqs" | grep -vx timm)
                _kha_install "$KHA_DEPS/bin/python" "$KHA_EXTRAS" "${_kha_reqs[@]}"
                { printf '%s\n' "$_kha_all_reqs"; cat "$KHA_DEPS/.kha-requirements" 2>/dev/null || true; } |
                    sort -u > "$KHA_DEPS/.kha-req.new"
                mv "$KHA_DEPS/.kha-req.new" "$KHA_DEPS/.kha-requirements"
            fi
        ) 9> "$KHA_DEPS.lock"
    fi
    if [ "$(cat "$KHA_STAMP" 2>/dev/null || true)" != "$_kha_hash $KHA_DEPS" ] || [ ! -x "$KHA_VENV/bin/python" ]; then
        if [ ! -x "$KHA_VENV/bin/python" ]; then
            echo "Creating $KHA_VENV" >&2
            python3 -m venv --without-pip "$KHA_VENV"  # pip and setuptools: the shared environment's
        fi
        echo "Installing kha-compile (editable) into $KHA_VENV, over the packages of $KHA_DEPS" >&2
        _kha_site="$("$KHA_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
        _kha_deps_site="$("$KHA_DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
        # `import` lines of a .pth file run at start-up: the shared packages come after .venv's own, and their
        # own .pth files are read too
        echo "import site; site.addsitedir('$_kha_deps_site')" > "$_kha_site/_kha_shared_deps.pth"
        "$KHA_VENV/bin/python" -m pip --disable-pip-version-check -q install --no-compile --no-deps \
            --no-build-isolation -e "$KHA_ROOT"
        _kha_relink=1
        echo "$_kha_hash $KHA_DEPS" > "$KHA_STAMP"
    fi
    [ "$_kha_relink" = 0 ] || _kha_link_scripts
else
    # everything in .venv (KHA_SHARED_DEPS=0, or a python3 older than 3.11)
    _kha_hash="$( (cat "$KHA_ROOT/pyproject.toml" "$KHA_ROOT/constraints.txt"; echo "torch=$KHA_TORCH $KHA_TORCH_INDEX") | sha256sum | cut -d' ' -f1)"
    if [ ! -x "$KHA_VENV/bin/python" ]; then
        echo "Creating $KHA_VENV" >&2
        python3 -m venv "$KHA_VENV"
    fi
    if ! _kha_has_extras "$(cat "$KHA_STAMP" 2>/dev/null || true)" "$KHA_EXTRAS"; then
        echo "Installing $KHA_TORCH and kha-compile[$KHA_EXTRAS] into $KHA_VENV" >&2
        _kha_install "$KHA_VENV/bin/python" "$KHA_EXTRAS" -e "$KHA_ROOT[$KHA_EXTRAS]"
        _kha_stamp "$KHA_STAMP" "$KHA_EXTRAS"
    fi
fi
unset _kha_hash _kha_all_reqs _kha_reqs _kha_site _kha_deps_site _kha_relink
unset -f _kha_has_extras _kha_stamp _kha_install _kha_requirements _kha_missing _kha_link_scripts
