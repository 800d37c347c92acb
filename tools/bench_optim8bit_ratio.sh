#!/bin/bash
# Issue 6's throughput ratio: the 8-bit AdamW update (AdamW8bitUpdate rows) against the
# compiled fp32 AdamW update of the same, 8-bit-eligible parameters (the generated
# optimizer kernels of adamw_torch minus those of the tensors adamw_8bit keeps in fp32),
# from ONE `kiln bench --optim adamw_torch,adamw_8bit --profile_by node` run of gpt_4l256
# (tools/prepare_bench_models.sh), batch 8: the two programs' steps alternate, so the
# machine's load falls on both alike. BENCH_STEPS (default 10) timed steps each, ROUNDS
# (default 2) runs. Usage: tools/bench_optim8bit_ratio.sh [KILN_BINARY]
# (default build/bin/kiln; a relative path is taken from the caller's folder;
# OMP_NUM_THREADS defaults to 2). Prints ms per BENCH_STEPS steps and fp32 / 8-bit
# (1 = equal speed).
set -euo pipefail
K=${1:-}
if [ -n "$K" ] && [ -e "$K" ]; then K=$(readlink -f "$K"); fi
cd "$(dirname "$0")/.."
K=${K:-build/bin/kiln}
[ -x "$K" ] || { echo "bench_optim8bit_ratio: $K is not an executable kiln binary" >&2; exit 1; }
M=build/examples/gpt_4l256/model.onnx
[ -f "$M" ] || { echo "bench_optim8bit_ratio: $M missing (run tools/prepare_bench_models.sh)" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
STEPS=${BENCH_STEPS:-10}
ROUNDS=${ROUNDS:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sum_ms() { awk '{s += $(NF-2)} END {print s + 0}'; }
# The rows of one variant's profile section ("profile (adamw_8bit): ..." up to the next).
section() { awk -v want="profile ($1):" 'index($0, "profile (") == 1 {on = index($0, want) == 1; next} on' "$2"; }
for r in $(seq 1 "$ROUNDS"); do
  if ! "$K" bench "$M" --per_device_train_batch_size 8 --optim adamw_torch,adamw_8bit --bench_steps "$STEPS" \
      --profile_by node --profile_row_limit 0 > "$tmp/out.txt" 2>&1; then
    echo "bench_optim8bit_ratio: kiln bench --optim adamw_torch,adamw_8bit failed:" >&2
    tail -n 5 "$tmp/out.txt" >&2
    exit 1
  fi
  section adamw_torch "$tmp/out.txt" > "$tmp/fp32.txt"
  section adamw_8bit "$tmp/out.txt" > "$tmp/q8.txt"
  all=$( { grep -E "optimizer/transformer" "$tmp/fp32.txt" || true; } | sum_ms)
  kept=$( { grep -E "optimizer/transformer" "$tmp/q8.txt" || true; } | { grep -v AdamW8bit || true; } | sum_ms)
  q8=$( { grep -E "AdamW8bitUpdate " "$tmp/q8.txt" || true; } | sum_ms)
  if [ "$q8" = "0" ] || [ "$all" = "0" ]; then
    echo "bench_optim8bit_ratio: no AdamW8bitUpdate or fp32 optimizer rows in the profiles (is $M the GPT of tools/prepare_bench_models.sh?)" >&2
    exit 1
  fi
  awk -v a="$all" -v k="$kept" -v q="$q8" -v r="$r" -v s="$STEPS" 'BEGIN {
    printf "run %d: fp32 update of the eligible tensors %.1f ms, 8-bit update %.1f ms (%d steps, alternating): ratio %.2fx\n",
           r, a - k, q, s, (a - k) / q }'
done
