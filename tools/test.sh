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
# A fixed libFuzzer seed: from the same seeds and an empty corpus (a fresh clone), a slower
# machine runs a prefix of the inputs a faster one runs, so CI does not fail on a finding
# that chance brought up; discovery is the job of the long runs by hand (docs/robustness.md).
bash tools/fuzz.sh all "${KILN_FUZZ_SECONDS:-20}" -seed=1
