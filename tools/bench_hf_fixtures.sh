#!/bin/bash
# Issue 29's speed point (docs/performance.md): compiled against eager training steps
# (fp32, AdamW) on every exported fixture of tests/data/hf (tools/make_hf_fixtures.sh),
# both backends in one kiln bench process (their steps alternate, so machine noise hits
# both alike). Prints one row per fixture: eager and compiled median seconds per step
# and their ratio.
# Needs build/bin/kiln. Usage: bash tools/bench_hf_fixtures.sh [STEPS]
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # OMP_WAIT_POLICY left as given: on a quiet machine the default (spinning) is right; passive adds a thread wake-up per parallel kernel (gpt2: ~1.4 ms per step)
steps=${1:-30}
files=$(python3 -c "
import json
m = json.load(open('tests/data/hf/manifest.json'))
print(' '.join(e['file'] for e in m['fixtures'] if e['exported']))")
printf '%-34s %12s %12s %8s\n' fixture eager_s compiled_s speedup
for f in $files; do
  model=${f%%/*}; variant=$(basename "$f" .onnx); variant=${variant%%_*}
  shape="batch=2,seq=8"; [ "$model" = vit ] && shape="batch=2"
  loss=cross_entropy; [ "$variant" = loss ] && loss=model
  out=$(build/bin/kiln bench "tests/data/hf/$f" --shape "$shape" --per_device_train_batch_size 2 --loss "$loss" \
        --backend eager,compiled --bench_steps "$steps" 2>&1)
  e=$(echo "$out" | awk '$1=="eager"{print $2}')
  c=$(echo "$out" | awk '$1=="compiled"{print $2}')
  if [ -z "$e" ] || [ -z "$c" ]; then echo "$f: bench failed"; echo "$out" | tail -3; continue; fi
  printf '%-34s %12s %12s %7.2fx\n' "$f" "$e" "$c" "$(python3 -c "print($e / $c)")"
done
