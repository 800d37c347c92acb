#!/bin/bash
# Issue 6's throughput ratio: the 8-bit AdamW update (AdamW8bitUpdate rows) against the
# compiled fp32 AdamW update of the same, 8-bit-eligible parameters (the generated
# optimizer kernels of adamw_torch minus those of the tensors adamw_8bit keeps in fp32),
# from `kiln bench --profile_by node` of gpt_4l256 (tools/prepare_bench_models.sh), batch 8,
# 5 timed steps each, twice. Usage: tools/bench_optim8bit_ratio.sh [KILN_BINARY]
# (default build/bin/kiln; a relative path is taken from the caller's folder;
# OMP_NUM_THREADS defaults to 2). Prints ms per 5 steps and fp32 / 8-bit (1 = equal speed).
# The ratio is noisy on a shared machine (0.5-0.7 between runs here): run it more than once.
set -euo pipefail
K=${1:-}
if [ -n "$K" ] && [ -e "$K" ]; then K=$(readlink -f "$K"); fi
cd "$(dirname "$0")/.."
K=${K:-build/bin/kiln}
[ -x "$K" ] || { echo "bench_optim8bit_ratio: $K is not an executable kiln binary" >&2; exit 1; }
M=build/examples/gpt_4l256/model.onnx
[ -f "$M" ] || { echo "bench_optim8bit_ratio: $M missing (run tools/prepare_bench_models.sh)" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows() {  # $1 = --optim, $2 = output file; a failed bench prints its last lines and stops the script
  if ! "$K" bench "$M" --per_device_train_batch_size 8 --optim "$1" --bench_steps 5 --profile_by node \
      --profile_row_limit 0 > "$2" 2>&1; then
    echo "bench_optim8bit_ratio: kiln bench --optim $1 failed:" >&2
    tail -n 5 "$2" >&2
    exit 1
  fi
}
sum_ms() { awk '{s += $(NF-2)} END {print s + 0}'; }
for r in 1 2; do
  rows adamw_torch "$tmp/fp32.txt"
  rows adamw_8bit "$tmp/q8.txt"
  all=$( { grep -E "optimizer/transformer" "$tmp/fp32.txt" || true; } | sum_ms)
  kept=$( { grep -E "optimizer/transformer" "$tmp/q8.txt" || true; } | { grep -v AdamW8bit || true; } | sum_ms)
  q8=$( { grep -E "AdamW8bitUpdate " "$tmp/q8.txt" || true; } | sum_ms)
  if [ "$q8" = "0" ]; then
    echo "bench_optim8bit_ratio: no AdamW8bitUpdate rows in the profile (is $M the GPT of tools/prepare_bench_models.sh?)" >&2
    exit 1
  fi
  awk -v a="$all" -v k="$kept" -v q="$q8" -v r="$r" 'BEGIN {
    printf "run %d: fp32 update of the eligible tensors %.1f ms, 8-bit update %.1f ms (5 steps): ratio %.2fx\n",
           r, a - k, q, (a - k) / q }'
done
