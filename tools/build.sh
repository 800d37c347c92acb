#!/usr/bin/env bash
# Installs the Debian dependencies (idempotent) and builds kiln into build/ (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
launcher=()
# ccache, when installed, makes rebuilds of other checkouts (git worktrees) cheap.
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"${KILN_JOBS:-2}" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
echo "build: ok (build/bin/kiln)"
