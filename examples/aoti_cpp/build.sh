#!/usr/bin/env bash
# Build kha_aoti_runner with one g++ command against the libtorch inside the torch wheel.
#
#   examples/aoti_cpp/build.sh [PYTHON] [OUT]      (defaults: python3, examples/aoti_cpp/kha_aoti_runner)
#
# PYTHON is the interpreter whose torch the runner links (the one that wrote the package: use the same
# torch version to build, to write and to run). CXX overrides the compiler (default g++).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${1:-python3}
OUT=${2:-$HERE/kha_aoti_runner}
read -r TORCH ABI < <("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))")
set -x
"${CXX:-g++}" -std=c++17 -O2 -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include" \
  "$HERE/main.cpp" -o "$OUT" \
  -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -ltorch -ltorch_cpu -lc10
