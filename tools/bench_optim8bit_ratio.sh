#!/bin/bash
# Issue 6's throughput ratio: the 8-bit AdamW update (AdamW8bitUpdate rows) against the
# compiled fp32 AdamW update of the same, 8-bit-eligible parameters (the generated
# optimizer kernels of adamw_torch minus those of the tensors adamw_8bit keeps in fp32),
# from `kiln bench --profile_by node` of gpt_4l256 (tools/prepare_bench_models.sh), batch 8,
# 5 timed steps each, twice. Usage: tools/bench_optim8bit_ratio.sh [KILN_BINARY]
# (OMP_NUM_THREADS defaults to 2). Prints ms per 5 steps and fp32 / 8-bit (1 = equal speed).
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-build/bin/kiln}
M=build/examples/gpt_4l256/model.onnx
[ -f "$M" ] || { echo "bench_optim8bit_ratio: $M missing (run tools/prepare_bench_models.sh)" >&2; exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows() { "$K" bench "$M" --per_device_train_batch_size 8 --optim "$1" --bench_steps 5 --profile_by node --profile_row_limit 0; }
for r in 1 2; do
  rows adamw_torch > "$tmp/fp32.txt" 2>&1
  rows adamw_8bit > "$tmp/q8.txt" 2>&1
  all=$(grep -E "optimizer/transformer" "$tmp/fp32.txt" | awk '{s += $(NF-2)} END {print s + 0}')
  kept=$(grep -E "optimizer/transformer" "$tmp/q8.txt" | grep -v AdamW8bit | awk '{s += $(NF-2)} END {print s + 0}')
  q8=$(grep -E "AdamW8bitUpdate " "$tmp/q8.txt" | awk '{s += $(NF-2)} END {print s + 0}')
  awk -v a="$all" -v k="$kept" -v q="$q8" -v r="$r" 'BEGIN {
    printf "run %d: fp32 update of the eligible tensors %.1f ms, 8-bit update %.1f ms (5 steps): ratio %.2fx\n",
           r, a - k, q, (q > 0 ? (a - k) / q : 0) }'
done
