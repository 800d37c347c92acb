#!/bin/bash
# Start-up of a compiled program (issue 30): time from process start to the end of
# training step 1 for gpt_4l256 bf16 (batch 8, seq 128), three ways, in interleaved rounds:
#   cold       kiln train with an empty compile cache (import, passes, codegen, step 1)
#   cache hit  kiln train again with that cache (program loaded: no import, no pass)
#   DIR/train  the `kiln compile` binary (program embedded: no import, no pass, no LLVM)
# Each run trains --max_steps 1 without checkpoints (no --save_steps) and no evaluation; the wall time
# of the whole process is measured (it also writes the trained model.onnx at the end, in
# every variant alike). Data loading is a 64 KiB .npy pair (well under a millisecond).
# Needs build/bin/kiln and build/examples/gpt_4l256 (tools/prepare_bench_models.sh).
# Usage: bash tools/bench_startup.sh [ROUNDS]
set -eu
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
M=build/examples/gpt_4l256/model.onnx
[ -f "$M" ] || { echo "bench_startup: $M missing (run tools/prepare_bench_models.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive
W=$(mktemp -d /tmp/kiln_startup.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$W"' EXIT
# 64 rows of 128 token ids (vocab 256) and their next-token labels, as int64 .npy files.
python3 - "$W" <<'PY'
import random, struct, sys
def npy(path, rows, cols, vals):
    hdr = "{'descr': '<i8', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, cols)
    hdr += " " * (63 - (10 + len(hdr)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode())
        f.write(struct.pack("<%dq" % len(vals), *vals))
random.seed(0)
toks = [random.randrange(256) for _ in range(64 * 129)]
x, y = [], []
for r in range(64):
    row = toks[r * 129:(r + 1) * 129]
    x += row[:128]; y += row[1:]
npy(sys.argv[1] + "/x.npy", 64, 128, x)
npy(sys.argv[1] + "/y.npy", 64, 128, y)
PY
DATA=(--train_data input=$W/x.npy --train_data labels=$W/y.npy --max_steps 1)
FLAGS=("${DATA[@]}" --loss cross_entropy --bf16 --per_device_train_batch_size 8 --learning_rate 1e-3
       --weight_decay 0.01)
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.3f}')"; }
build/bin/kiln compile "$M" -o "$W/prog" "${FLAGS[@]}" > "$W/compile.log" 2>&1 ||
  { cat "$W/compile.log"; exit 1; }
echo "round cold_s cache_hit_s dir_train_s dir/cold"
for r in $(seq 1 "$ROUNDS"); do
  rm -rf "$W/cache" "$W/o1" "$W/o2" "$W/o3"
  t0=$(now); build/bin/kiln train "$M" "${FLAGS[@]}" --cache_dir "$W/cache" --output_dir "$W/o1" > "$W/cold.log" 2>&1 ||
    { cat "$W/cold.log"; exit 1; }
  t1=$(now); build/bin/kiln train "$M" "${FLAGS[@]}" --cache_dir "$W/cache" --output_dir "$W/o2" > "$W/hit.log" 2>&1 ||
    { cat "$W/hit.log"; exit 1; }
  t2=$(now); "$W/prog/train" "${DATA[@]}" --output_dir "$W/o3" > "$W/dir.log" 2>&1 || { cat "$W/dir.log"; exit 1; }
  t3=$(now)
  cold=$(secs "$t0" "$t1"); hit=$(secs "$t1" "$t2"); dir=$(secs "$t2" "$t3")
  echo "$r $cold $hit $dir $(python3 -c "print(f'{$dir / $cold:.3f}')")"
done
echo "step 1 loss: cold $(grep -o '"train_loss":[0-9.e+-]*' "$W/o1/metrics.jsonl" | head -1), cache hit $(grep -o '"train_loss":[0-9.e+-]*' "$W/o2/metrics.jsonl" | head -1), DIR/train $(grep -o '"train_loss":[0-9.e+-]*' "$W/o3/metrics.jsonl" | head -1)"
echo "step 1 alone (train_runtime of each run's metrics.jsonl): cold $(grep -o '"train_runtime":[0-9.]*' "$W/o1/metrics.jsonl" | cut -d: -f2) s, DIR/train $(grep -o '"train_runtime":[0-9.]*' "$W/o3/metrics.jsonl" | cut -d: -f2) s"
