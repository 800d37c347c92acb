#!/bin/bash
# oneDNN 2.6 (Debian) against oneDNN 3.x (PyPI) on kiln's ResNet-18 (width 8, 32x32)
# convolutions and a few GEMMs, plain NCHW against format_tag::any layouts.
# tools/onednn_versions.cpp is compiled twice; both binaries run interleaved, ROUNDS times
# per block, and the table reports the median over rounds of each per-call median.
#
# The PyPI package: onednn-cpu-gomp / onednn-devel-cpu-gomp 2023.2.0 = oneDNN 3.2.0, the
# newest PyPI oneDNN 3.x built for CPU with GNU OpenMP (like Debian's 2.6). The newer
# `onednn` / `onednn-devel` wheels (2024.0.0 .. 2026.1.0 = oneDNN 3.x up to 3.13) are
# built with DNNL_CPU_RUNTIME=SYCL: they need libsycl, the Intel compiler runtime and the
# OpenCL CPU runtime (dpcpp-cpp-rt, intel-opencl-rt) and run CPU work through SYCL/TBB,
# so they are not a drop-in for kiln's OpenMP build.
#
# Each run waits (up to IDLE_WAIT_S s) for an idle machine and records how many cores
# other processes used meanwhile; the medians use only quiet runs (others <= 0.3 cores)
# when there are any. Columns "min" are the fastest single call (contention-robust).
#
# Usage: bash tools/bench_onednn.sh [ROUNDS]     (default 3; writes build/onednn_bench/)
set -eu
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
PYPI_VER=2023.2.0
OUT=build/onednn_bench
PREFIX=build/onednn3   # pip --prefix of the PyPI wheels
mkdir -p "$OUT"

if [ ! -f "$PREFIX/.installed-$PYPI_VER" ]; then
  rm -rf "$PREFIX"
  python3 -m pip install --quiet --no-deps --prefix "$PREFIX" \
    "onednn-cpu-gomp==$PYPI_VER" "onednn-devel-cpu-gomp==$PYPI_VER"
  touch "$PREFIX/.installed-$PYPI_VER"
fi
# The wheels put headers and libraries as data files: under --prefix they land in
# $PREFIX/include and $PREFIX/lib (pip --target would drop the libraries).
INC3=$(cd "$PREFIX/include" && pwd)
LIB3=$(cd "$PREFIX/lib" && pwd)

g++ -O2 -std=c++17 -o "$OUT/bench_dnnl2" tools/onednn_versions.cpp -ldnnl
g++ -O2 -std=c++17 -I"$INC3" -o "$OUT/bench_dnnl3" tools/onednn_versions.cpp -L"$LIB3" -l:libdnnl.so.3 \
  -Wl,-rpath,"$LIB3"
ldd "$OUT/bench_dnnl2" | grep -E 'dnnl|omp|tbb' | sed 's/^/# bench_dnnl2: /'
ldd "$OUT/bench_dnnl3" | grep -E 'dnnl|omp|tbb' | sed 's/^/# bench_dnnl3: /'

export OMP_NUM_THREADS=2
# OMP_WAIT_POLICY is left as given (unset: libgomp spins a while, then sleeps). With
# passive, every parallel region pays a thread wake-up (~30-60 us on this VM when idle),
# which dominates these tiny convolutions.
echo "# OMP_NUM_THREADS=$OMP_NUM_THREADS OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset}"
# Busy and total jiffies of all CPUs (/proc/stat), to tell how much of the machine other
# processes used while a binary ran (the machine may be shared).
cpu_jiffies() { awk '/^cpu /{b=$2+$3+$4+$7+$8+$9; print b, b+$5+$6; exit}' /proc/stat; }
# Waits (up to IDLE_WAIT_S, default 180 s) until the CPUs are at least 85% idle over 1 s.
wait_idle() {
  local t=0 b0 a0 b1 a1
  while [ "$t" -lt "${IDLE_WAIT_S:-180}" ]; do
    read -r b0 a0 < <(cpu_jiffies); sleep 1; read -r b1 a1 < <(cpu_jiffies)
    [ $((100 * (b1 - b0))) -le $((15 * (a1 - a0))) ] && return 0
    t=$((t + 1))
  done
  echo "# warning: machine still busy after ${IDLE_WAIT_S:-180} s" >&2
}
HZ=$(getconf CLK_TCK)
RAW="$OUT/raw.tsv"
: > "$RAW"
: > "$OUT/load.txt"
echo "# start: $(uptime)"
for block in conv_f32_n4 conv_f32_n32 conv_bf16_n32 gemm_f32 gemm_bf16; do
  for r in $(seq 1 "$ROUNDS"); do
    # alternate which version goes first from round to round
    if [ $((r % 2)) = 1 ]; then order="2 3"; else order="3 2"; fi
    for v in $order; do
      wait_idle
      read -r b0 a0 < <(cpu_jiffies); t0=$(date +%s.%N)
      "$OUT/bench_dnnl$v" "$block" > "$OUT/last.txt"
      read -r b1 a1 < <(cpu_jiffies); t1=$(date +%s.%N)
      sed "s/^/$v\t$r\t/" "$OUT/last.txt" >> "$RAW"
      # others' CPU use during the run, in cores: (all busy - this binary's CPU) / wall
      awk -v v="$v" -v r="$r" -v blk="$block" -v busy=$((b1 - b0)) -v hz="$HZ" -v w="$(echo "$t1 - $t0" | bc)" \
        '/^@/{o=(busy/hz-$3)/w; if (o<0) o=0; printf "# %s round %s oneDNN-%s: wall %.1f s, self %.2f cores, others %.2f cores\n", blk, r, v, w, $3/w, o}' \
        "$OUT/last.txt" | tee -a "$OUT/load.txt"
    done
  done
done
echo "# end: $(uptime)"
grep -P '^\d\t\d+\t#' "$RAW" | cut -f3- | sort -u

python3 - "$RAW" "$OUT/load.txt" <<'EOF'
import sys, statistics, collections, re
raw, loadf = sys.argv[1], sys.argv[2]
QUIET = 0.3  # a run counts as quiet when other processes used at most this many cores
others = {}
for line in open(loadf):
    m = re.match(r"# (\S+) round (\d+) oneDNN-(\d): .* others (-?[\d.]+) cores", line)
    if m:
        others[(m[1], m[2], m[3])] = float(m[4])
runs = collections.defaultdict(list)   # (v, group, name, op, layout) -> [(round, ms, rms, min)]
impl, fmts, order = {}, {}, []
for line in open(raw):
    f = line.rstrip("\n").split("\t")
    if len(f) < 3 or f[2] != "R":
        continue
    v, r, _, group, name, op, layout, ms, mn, rms, im, fm = f
    k = (group, name, op, layout)
    if k not in order:
        order.append(k)
    runs[(v,) + k].append((r, float(ms), float(rms), float(mn)))
    impl[(v,) + k], fmts[(v,) + k] = im, fm
used = {}
def pick(v, k):
    rs = runs.get((v,) + k, [])
    quiet = [x for x in rs if others.get((k[0], x[0], v), 0.0) <= QUIET]
    used[(v, k[0])] = (len(quiet) if quiet else 0, len(rs))
    return quiet or rs
def med(v, k, i):
    rs = pick(v, k)
    return statistics.median(x[i] for x in rs) if rs else float("nan")

# ResNet-18 (BasicBlock x [2,2,2,2]) occurrences per step; conv1's backward-data is
# excluded from the step sum (the input needs no gradient).
count = {"conv1_3to8_7x7s2_32": 1, "c3_8to8_8x8": 4, "c3_16to16_4x4": 3, "c3_32to32_2x2": 3,
         "c3_64to64_1x1": 3, "c3s2_8to16_8x8": 1, "c3s2_16to32_4x4": 1, "c3s2_32to64_2x2": 1,
         "ds1x1s2_8to16_8x8": 1, "ds1x1s2_16to32_4x4": 1, "ds1x1s2_32to64_2x2": 1}
groups = []
for k in order:
    if k[0] not in groups:
        groups.append(k[0])
for g in groups:
    print(f"\n### {g}\n")
    print("| shape | op | layout | 2.6 ms | 3.x ms | 3.x/2.6 | 2.6 reorders ms | 3.x reorders ms | 2.6 min | 3.x min |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for k in order:
        if k[0] != g:
            continue
        a, b = med("2", k, 1), med("3", k, 1)
        rr = f"{med('2', k, 2):.4f} | {med('3', k, 2):.4f}" if k[3] == "any" else " | "
        print(f"| {k[1]} | {k[2]} | {k[3]} | {a:.4f} | {b:.4f} | {b / a:.2f} | {rr} | "
              f"{med('2', k, 3):.4f} | {med('3', k, 3):.4f} |")
    print(f"\nquiet runs used (others <= {QUIET} cores): 2.6 {used[('2', g)][0]}/{used[('2', g)][1]}, "
          f"3.x {used[('3', g)][0]}/{used[('3', g)][1]} (0 = none quiet, all used)")
    if g.startswith("conv"):
        tot = collections.defaultdict(float)
        for k in order:
            if k[0] != g or (k[1].startswith("conv1") and k[2] == "bwd_data"):
                continue
            c = count[k[1]]
            for v in "23":
                for i, s in ((1, "p"), (2, "r"), (3, "m")):
                    tot[(v, k[3], s)] += c * med(v, k, i)
        for stat, name in (("p", "medians"), ("m", "minimums")):
            print(f"\none step's convolutions ({g}, {name}): 2.6 plain {tot[('2','plain',stat)]:.3f} ms, "
                  f"3.x plain {tot[('3','plain',stat)]:.3f} ms, 3.x any {tot[('3','any',stat)]:.3f} ms "
                  f"(+reorders {tot[('3','any','r')]:.3f}); 2.6 any {tot[('2','any',stat)]:.3f} ms "
                  f"(+reorders {tot[('2','any','r')]:.3f})")

print("\n### implementations (impl_info_str; formats for any: inputs..., output)\n")
print("| group | shape | op | layout | 2.6 impl | 3.x impl | 2.6 formats | 3.x formats |")
print("|---|---|---|---|---|---|---|---|")
for k in order:
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {impl.get(('2',)+k,'-')} | {impl.get(('3',)+k,'-')} | "
          f"{fmts.get(('2',)+k,'') if k[3]=='any' else ''} | {fmts.get(('3',)+k,'') if k[3]=='any' else ''} |")
EOF
