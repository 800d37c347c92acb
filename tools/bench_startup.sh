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
# Each run is traced (strace --seccomp-bpf: only execve and openat stop the process, so the
# trace costs microseconds): "to step 1" is from the execve to the openat of
# model.safetensors.tmp, the first file the final save opens (step 1's metrics line is
# written before it); "to exit" is the whole process.
command -v strace >/dev/null || { echo "bench_startup: strace is not installed (apt-get install strace)" >&2; exit 2; }
traced() {  # traced NAME COMMAND...: runs COMMAND, prints "TO_STEP1 TO_EXIT" in seconds
  local name=$1
  shift
  local t0 t1
  t0=$(date +%s.%N)
  strace -f --seccomp-bpf -ttt -e trace=execve,openat -o "$W/$name.trace" "$@" > "$W/$name.log" 2>&1 ||
    { cat "$W/$name.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  python3 - "$W/$name.trace" "$t0" "$t1" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
start = next(float(l.split()[1]) for l in lines if " execve(" in l)
save = next(float(l.split()[1]) for l in lines if "model.safetensors.tmp" in l)
print(f"{save - start:.3f} {float(sys.argv[3]) - float(sys.argv[2]):.3f}")
PY
}
build/bin/kiln compile "$M" -o "$W/prog" "${FLAGS[@]}" > "$W/compile.log" 2>&1 ||
  { cat "$W/compile.log"; exit 1; }
echo "round | to end of step 1: cold, cache hit, DIR/train, DIR/cold | to exit: cold, cache hit, DIR/train, DIR/cold"
for r in $(seq 1 "$ROUNDS"); do
  rm -rf "$W/cache" "$W/o1" "$W/o2" "$W/o3"
  read -r c1 ce < <(traced cold build/bin/kiln train "$M" "${FLAGS[@]}" --cache_dir "$W/cache" --output_dir "$W/o1")
  read -r h1 he < <(traced hit build/bin/kiln train "$M" "${FLAGS[@]}" --cache_dir "$W/cache" --output_dir "$W/o2")
  read -r d1 de < <(traced dir "$W/prog/train" "${DATA[@]}" --output_dir "$W/o3")
  python3 -c "print(f'$r | $c1 $h1 $d1 {$d1 / $c1:.3f} | $ce $he $de {$de / $ce:.3f}')"
done
loss() { grep -o '"train_loss":[0-9.e+-]*' "$1/metrics.jsonl" | head -1 | cut -d: -f2; }
runtime() { grep -o '"train_runtime":[0-9.]*' "$1/metrics.jsonl" | cut -d: -f2; }
echo "step 1 loss: cold $(loss "$W/o1"), cache hit $(loss "$W/o2"), DIR/train $(loss "$W/o3")"
echo "step 1 alone (train_runtime in metrics.jsonl): cold $(runtime "$W/o1") s, cache hit $(runtime "$W/o2") s, DIR/train $(runtime "$W/o3") s"
