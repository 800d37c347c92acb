#!/usr/bin/env bash
# Sets up, builds and runs kiln's whole test suite (ctest). Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
bash tools/prepare_test_data.sh
cd build
ctest --output-on-failure -j"${KILN_JOBS:-2}" --timeout 900
