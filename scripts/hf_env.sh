#!/usr/bin/env bash
# A side environment with another transformers release, kept outside the clone (the oldest release of
# pyproject's range, for tests/parallel/test_transformers_versions.py).
#
#   bash scripts/hf_env.sh 4.51.0     # build it on first use (about a minute), then print its python's path
#   bash scripts/hf_env.sh --tested   # the releases the tests run (scripts/test.sh builds them in the background):
#                                     # pyproject's oldest, and 5.15.0 (it shards with plain local tensors)
#
# It holds the pinned torch (installed first, so nothing replaces it), transformers==VERSION with the
# huggingface_hub / tokenizers that release asks for, accelerate (its tensor-parallel loading needs it) and
# kha_compile's own dependencies; kha_compile itself comes from the clone on PYTHONPATH. It lives in
# ${KHA_HF_CACHE:-~/.cache/kha_compile}/hf-<VERSION>-<hash>, the hash taken over the torch and accelerate pins,
# the RECIPE number below and the Python version, so later clones and CI runs reuse it.
#
# Safe to run concurrently and after a crash (flock; an environment counts as built once its stamp is
# written last). A build that fails leaves hf-<VERSION>-<hash>.failed (the reason) and exits 3; the tests
# skip with that reason.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:?usage: bash scripts/hf_env.sh TRANSFORMERS_VERSION | --tested}"
if [ "$VERSION" = "--tested" ]; then
    oldest="$(grep -o -E '"transformers>=[0-9.]+"' "$ROOT/pyproject.toml" | head -n 1 | tr -d '"' | cut -d= -f2)"
    for v in "$oldest" 5.15.0; do bash "${BASH_SOURCE[0]}" "$v" || true; done
    exit 0
fi
TORCH_PIN="$(grep -E '^torch==' "$ROOT/constraints.txt")"
ACCELERATE_PIN="$(grep -E '^accelerate==' "$ROOT/constraints.txt")"
PIP_OPTS=(--disable-pip-version-check -q --retries 1 --timeout 60)
RECIPE=1  # bump when the way the environment is built changes

CACHE="${KHA_HF_CACHE:-$HOME/.cache/kha_compile}"
mkdir -p "$CACHE"
HASH="$( (echo "$TORCH_PIN $ACCELERATE_PIN recipe $RECIPE"; python3 --version) | sha256sum | cut -c1-12)"
ENV="$CACHE/hf-$VERSION-$HASH"
STAMP="$ENV/.kha-hf-ready"
FAILED="$ENV.failed"

if [ ! -f "$STAMP" ]; then
    exec 9>"$ENV.lock"
    flock 9
    if [ ! -f "$STAMP" ]; then  # not built meanwhile by a process we waited for
        rm -rf "$ENV" "$FAILED"
        log="$ENV.log"
        echo "Building the transformers $VERSION environment in $ENV (first use: about a minute). Log: $log" >&2
        start=$SECONDS
        if ! {
            python3 -m venv "$ENV" \
                && "$ENV/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile "$TORCH_PIN" \
                && "$ENV/bin/python" -m pip "${PIP_OPTS[@]}" install --no-compile "$TORCH_PIN" "transformers==$VERSION" \
                    "$ACCELERATE_PIN" safetensors numpy rich \
                && "$ENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
        } >"$log" 2>&1; then
            reason="$(grep -v -E '^\s*$|is ignored: it is neither' "$log" | tail -n 3 | tr '\n' ' ')"
            echo "could not build the transformers $VERSION environment in $ENV: $reason (full log: $log)" > "$FAILED"
            rm -rf "$ENV"
            cat "$FAILED" >&2
            exit 3
        fi
        echo "built in $((SECONDS - start)) s: $(tail -n 1 "$log")" > "$STAMP"
        echo "Built the transformers $VERSION environment in $((SECONDS - start)) s: $ENV" >&2
    fi
    flock -u 9
fi
echo "$ENV/bin/python"
