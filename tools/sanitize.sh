#!/usr/bin/env bash
# kiln under AddressSanitizer + UndefinedBehaviorSanitizer (issue 36).
#
#   bash tools/sanitize.sh            # the whole unit test suite (ctest; labels gpu and lint
#                                     # excluded) with all of kiln built by g++ with
#                                     # -fsanitize=address,undefined -fno-sanitize-recover=undefined
#                                     # (CMake option KILN_SANITIZE) into build-asan/
#                                     # (RelWithDebInfo, -O1 -g): long, run by hand
#   bash tools/sanitize.sh --quick    # test_readers only (what tools/test.sh runs): the
#                                     # reader-level tests (tests/ir graph and op-name tests,
#                                     # tests/frontend import, export and versions tests,
#                                     # tests/runtime io and fuzz-regression tests), built by
#                                     # clang-14 with ASan+UBSan in build-fuzz/ from the same
#                                     # objects as the fuzz targets (fuzz/CMakeLists.txt)
#
# Any sanitizer report fails the run (ASan aborts; UBSan does not recover; leaks are
# reported at exit). Extra arguments go to ctest (full) or to test_readers (--quick).
set -euo pipefail
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if [ "${1:-}" = --quick ]; then
  shift
  bash tools/install_deps.sh
  bash tools/fuzz.sh --build test_readers
  echo "sanitize: test_readers (clang-14, ASan+UBSan)"
  build-fuzz/test_readers --gtest_brief=1 "$@"
  exit 0
fi
bash tools/install_deps.sh
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
mkdir -p build-asan
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DKILN_SANITIZE=ON "${launcher[@]}" > build-asan/build.log 2>&1 || { cat build-asan/build.log; exit 1; }
cmake --build build-asan -j"${KILN_JOBS:-2}" >> build-asan/build.log 2>&1 || { tail -50 build-asan/build.log; exit 1; }
echo "sanitize: the unit test suite (g++, ASan+UBSan)"
cd build-asan
ctest --output-on-failure -j"${KILN_JOBS:-2}" --timeout 3600 -LE 'gpu|lint' "$@"
