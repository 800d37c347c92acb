#!/usr/bin/env bash
# Sets up, builds and runs kiln's whole test suite (ctest). Used by .ci/run.
# Then (issue 36) each libFuzzer target for a short time (tools/fuzz.sh all, KILN_FUZZ_SECONDS
# each, default 20; build-fuzz/) and the reader-level unit tests under ASan+UBSan
# (tools/sanitize.sh --quick; build-asan/). Any failure fails the script; a missing clang
# or libFuzzer runtime is a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
bash tools/prepare_test_data.sh
(cd build && ctest --output-on-failure -j"${KILN_JOBS:-2}" --timeout 900)
bash tools/sanitize.sh --quick
bash tools/fuzz.sh all "${KILN_FUZZ_SECONDS:-20}"
