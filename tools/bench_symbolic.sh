#!/usr/bin/env bash
# The symbolic-vs-static step-time table of docs/dynamic_shapes.md (issue 32): for each
# model, precision and --symbolic_versions setting, `kiln bench --shape_mode pad,symbolic`
# at seq 32, 64, 128 and 256 (the static program built for that length against the
# symbolic program run at it, steps alternating), then the geometric mean of the
# symbolic / static median-step ratio over the four lengths.
#
# Usage: tools/bench_symbolic.sh [MODEL...]   (default: tiny_gpt_dyn gpt_4l256_dyn)
# Needs build/bin/kiln and the models of tools/prepare_bench_models.sh.
# Environment: STEPS (timed steps, default 30), VERSIONS (default "on off").
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=build/bin/kiln
STEPS=${STEPS:-30}
VERSIONS=${VERSIONS:-"on off"}
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(tiny_gpt_dyn gpt_4l256_dyn)
[ -x "$KILN" ] || { echo "bench_symbolic: build kiln first (tools/build.sh)" >&2; exit 1; }
# Median step of a bench row ("static 8.94 ms ..."), in ms.
ms_of() {
  awk -v mode="$1" '$1 == mode { v = $2; if ($3 == "s") v *= 1000; if ($3 == "us") v /= 1000; print v }'
}
echo "| model | precision | versions | seq 32 | 64 | 128 | 256 | geomean |"
echo "|---|---|---|---|---|---|---|---|"
for m in "${MODELS[@]}"; do
  onnx=build/examples/$m/model.onnx
  [ -f "$onnx" ] || { echo "bench_symbolic: $onnx is missing (tools/prepare_bench_models.sh)" >&2; exit 1; }
  for prec in fp32 bf16; do
    for v in $VERSIONS; do
      row="| $m | $prec | $v |"
      logsum=0
      for L in 32 64 128 256; do
        flags=(--shape "seq=$L" --shape_mode pad,symbolic --backend compiled --bench_steps "$STEPS"
          --per_device_train_batch_size 8 --symbolic_versions "$v")
        [ "$prec" = bf16 ] && flags+=(--bf16)
        out=$("$KILN" bench "$onnx" "${flags[@]}" 2>&1) || { echo "$out" >&2; exit 1; }
        s=$(echo "$out" | ms_of static)
        y=$(echo "$out" | ms_of symbolic)
        row="$row $y / $s |"
        logsum=$(awk -v a="$logsum" -v y="$y" -v s="$s" 'BEGIN { print a + log(y / s) }')
      done
      echo "$row $(awk -v a="$logsum" 'BEGIN { printf "%.3f", exp(a / 4) }') |"
    done
  done
done
