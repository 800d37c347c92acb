#!/usr/bin/env bash
# Builds and runs kiln's libFuzzer targets (issue 36; fuzz/harness.h lists what each reads).
#
#   bash tools/fuzz.sh TARGET SECONDS [libFuzzer flags...]   # one target
#   bash tools/fuzz.sh all SECONDS [libFuzzer flags...]      # each target in turn, SECONDS each
#
# TARGET: onnx npy safetensors trainer_state config tokens program sequences.
# Builds with Debian's clang-14 (-fsanitize=fuzzer,address,undefined) into build-fuzz/
# (fuzz/CMakeLists.txt; ccache when installed). Seeds: fuzz/seeds/TARGET/ plus the test
# fixtures of that format (tests/data, examples/; files up to 64 KB; JSON targets use
# the dictionary fuzz/dicts/json.dict, sequences fuzz/dicts/sequences.dict), gathered into
# build-fuzz/seeds/TARGET/ on each run; the corpus the fuzzer grows is kept in
# build-fuzz/corpus/TARGET/ across runs. A crash, leak, timeout (10 s) or sanitizer report
# ends the run with exit status 1 and writes the input to build-fuzz/crashes/TARGET/;
# fix the reader, then add the input under tests/data/fuzz_regressions/TARGET/ (replayed by
# test_runtime's FuzzRegressions through the same harness, in the normal build). Without
# clang or its libFuzzer runtime the script fails (it never skips).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=(onnx npy safetensors trainer_state config tokens program sequences)
build_only=()
if [ "${1:-}" = --build ]; then  # tools/fuzz.sh --build CMAKE_TARGET...: only build (tools/sanitize.sh --quick)
  shift
  build_only=("$@")
  [ ${#build_only[@]} -gt 0 ] || { echo "usage: tools/fuzz.sh --build CMAKE_TARGET..." >&2; exit 2; }
  run=()
elif [ $# -lt 2 ]; then
  echo "usage: tools/fuzz.sh TARGET|all SECONDS [libFuzzer flags...]   (targets: ${TARGETS[*]})" >&2
  exit 2
fi
if [ ${#build_only[@]} -gt 0 ]; then
  :
else
target=$1
seconds=$2
shift 2
if [ "$target" = all ]; then
  run=("${TARGETS[@]}")
else
  case " ${TARGETS[*]} " in
    *" $target "*) run=("$target") ;;
    *) echo "tools/fuzz.sh: unknown target '$target' (targets: ${TARGETS[*]} all)" >&2; exit 2 ;;
  esac
fi
fi

CXX=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$CXX" ]; then
  echo "tools/fuzz.sh: FAILED: clang++ (clang-14) is not installed; run tools/install_deps.sh" >&2
  exit 1
fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
  "$CXX" -x c++ -fsanitize=fuzzer,address,undefined - -o /tmp/kiln-fuzz-probe.$$ 2>/tmp/kiln-fuzz-probe.$$.log; then
  cat /tmp/kiln-fuzz-probe.$$.log >&2
  echo "tools/fuzz.sh: FAILED: $CXX cannot link -fsanitize=fuzzer (libclang_rt.fuzzer missing?); run tools/install_deps.sh" >&2
  rm -f /tmp/kiln-fuzz-probe.$$ /tmp/kiln-fuzz-probe.$$.log
  exit 1
fi
rm -f /tmp/kiln-fuzz-probe.$$ /tmp/kiln-fuzz-probe.$$.log

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # Paths hashed relative to the checkout, and -g objects shared between checkouts (CI's
  # clone, git worktrees): a rebuild elsewhere hits the cache (debug info then names the
  # first checkout's paths).
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
fi
mkdir -p build-fuzz
# One build at a time in build-fuzz/ (a fuzz run and tools/sanitize.sh --quick side by side).
exec 9> build-fuzz/build.lock
flock 9
cmake -S fuzz -B build-fuzz -DCMAKE_CXX_COMPILER="$CXX" "${launcher[@]}" > build-fuzz/build.log 2>&1 ||
  { cat build-fuzz/build.log; exit 1; }
build_targets=()
for t in "${run[@]}"; do build_targets+=(--target "fuzz_$t"); done
for t in "${build_only[@]}"; do build_targets+=(--target "$t"); done
cmake --build build-fuzz -j"${KILN_JOBS:-2}" "${build_targets[@]}" >> build-fuzz/build.log 2>&1 ||
  { tail -50 build-fuzz/build.log; exit 1; }
[ ${#build_only[@]} -gt 0 ] && exit 0
exec 9>&-

# Seed files of a target: checked-in seeds, then fixtures of its format (up to 64 KB).
seed_files() {
  local t=$1
  [ -d "fuzz/seeds/$t" ] && find "fuzz/seeds/$t" -type f
  case $t in
    onnx) find tests/data examples -name '*.onnx' -size -65k ;;
    npy) find tests/data examples -name '*.npy' -size -65k ;;
    safetensors) find tests/data examples -name '*.safetensors' -size -65k ;;
    tokens) find tests/data examples -name '*.bin' -size -65k ;;
    config | trainer_state) find tests/data examples -name '*.json' -size -65k ;;
    sequences) find tests/data examples -name '*.jsonl' -size -65k ;;
  esac
  [ -d "tests/data/fuzz_regressions/$t" ] && find "tests/data/fuzz_regressions/$t" -type f
  return 0
}

status=0
for t in "${run[@]}"; do
  seeds=build-fuzz/seeds/$t
  rm -rf "$seeds"
  mkdir -p "$seeds" "build-fuzz/corpus/$t" "build-fuzz/crashes/$t"
  n=0
  while IFS= read -r f; do
    n=$((n + 1))
    cp "$f" "$seeds/$n-$(basename "$f")"
  done < <(seed_files "$t")
  echo "fuzz $t: ${seconds}s, $n seed files, corpus build-fuzz/corpus/$t ($(find "build-fuzz/corpus/$t" -type f | wc -l) files)"
  log=build-fuzz/fuzz_$t.log
  # Program payloads with kernels run to ~120 KB (fuzz/seeds/program); others stay small.
  opts=(-max_len=65536)
  [ "$t" = program ] && opts=(-max_len=262144)
  case $t in
    config | trainer_state) opts+=(-dict=fuzz/dicts/json.dict) ;;
    sequences) opts+=(-dict=fuzz/dicts/sequences.dict) ;;
  esac
  # -rss_limit_mb: the readers refuse sizes they cannot allocate; more than 2 GB is a finding.
  if ! ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "build-fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "${opts[@]}" \
    -print_final_stats=1 -artifact_prefix="build-fuzz/crashes/$t/" "$@" \
    "build-fuzz/corpus/$t" "$seeds" > "$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz $t: FAILED (log $log; inputs in build-fuzz/crashes/$t/)" >&2
    status=1
    continue
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
  echo "fuzz $t: ok, $execs runs, $speed exec/s, $cov, corpus $(find "build-fuzz/corpus/$t" -type f | wc -l) files"
done
exit $status
