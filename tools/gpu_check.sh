#!/usr/bin/env bash
# GPU check of kiln's CUDA backend (issue 9): runs the prebuilt tests/gpu binary (test_gpu:
# NVRTC compiles + every corpus kernel run on the GPU and compared with
# codegen::evaluate_reference) on the GPU machine, from the repository root. ~1-3 minutes.
#
# How the lead calls it:
#   1. Build HERE (the GPU machine has no LLVM/oneDNN/onnx/protobuf, so do not build there):
#        cmake -S /work/main -B /work/build-cu -DCMAKE_BUILD_TYPE=Release
#        make -C /work/build-cu -j2 test_gpu
#        /work/build-cu/bin/test_gpu --gtest_brief=1        # compile tests pass, device tests skip
#        mkdir -p /work/main/build-gpu/bin && cp /work/build-cu/bin/test_gpu /work/main/build-gpu/bin/
#      (build-gpu/ is git-ignored by `build-*/`; the binary is ~3 MiB and needs only glibc,
#       libnvrtc.so.13 and, at run time, libcuda.so.1: libstdc++/libgcc/gtest are static.)
#   2. One device run:  run(command="bash tools/gpu_check.sh", carry=["build-gpu"], timeout_s=300)
#      Optional argument: another path to test_gpu. Extra arguments go to the test binary
#      (e.g. --gtest_filter=Corpus/*).
#
# It prints the GPU's name, finds libnvrtc.so.13 and the CUDA headers (cuda_bf16.h) if the
# defaults (/usr/local/cuda) are absent, runs test_gpu with KILN_REQUIRE_GPU=1 (a missing
# device is then a failure, not a skip) and exits non-zero on any failure.
set -u
cd "$(dirname "$0")/.." || exit 2

BIN="${1:-build-gpu/bin/test_gpu}"
[ $# -gt 0 ] && shift
if [ ! -f "$BIN" ]; then
  echo "gpu_check: $BIN not found (build it as described at the top of tools/gpu_check.sh and carry build-gpu)" >&2
  exit 2
fi
chmod +x "$BIN" 2>/dev/null

if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
else
  echo "gpu_check: nvidia-smi not found"
fi

# Candidate CUDA library and include folders (toolkit installs, then pip wheels).
py_nvidia=""
for py in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
  d=$("$py" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null) && [ -n "$d" ] && { py_nvidia="$d"; break; }
done
lib_dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64
          /usr/local/cuda-*/targets/x86_64-linux/lib)
inc_dirs=(/usr/local/cuda/include /usr/local/cuda/targets/x86_64-linux/include /usr/local/cuda-*/include)
if [ -n "$py_nvidia" ]; then
  lib_dirs+=("$py_nvidia"/cu13/lib "$py_nvidia"/cuda_nvrtc/lib)
  inc_dirs+=("$py_nvidia"/cu13/include "$py_nvidia"/cuda_runtime/include)
fi

if ldd "$BIN" | grep -q 'libnvrtc.so.13 => not found'; then
  for d in "${lib_dirs[@]}"; do
    if [ -e "$d/libnvrtc.so.13" ]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "gpu_check: libnvrtc.so.13 from $d"
      break
    fi
  done
fi
if ldd "$BIN" | grep -q 'not found'; then
  echo "gpu_check: missing libraries:" >&2
  ldd "$BIN" | grep 'not found' >&2
  exit 2
fi
# libcuda.so.1 is dlopen'ed by the binary: make sure the loader can find it.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '; then
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
    if [ -e "$d/libcuda.so.1" ]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "gpu_check: libcuda.so.1 from $d"
      break
    fi
  done
fi
if [ -z "${KILN_CUDA_INCLUDE:-}" ] && [ ! -e /usr/local/cuda/include/cuda_bf16.h ]; then
  for d in "${inc_dirs[@]}"; do
    if [ -e "$d/cuda_bf16.h" ]; then
      export KILN_CUDA_INCLUDE="$d"
      echo "gpu_check: CUDA headers from $d"
      break
    fi
  done
fi

export KILN_REQUIRE_GPU=1
start=$(date +%s)
timeout 280 "$BIN" --gtest_brief=1 "$@"
rc=$?
echo "gpu_check: test_gpu exited with $rc after $(( $(date +%s) - start )) s"
[ $rc -eq 124 ] && echo "gpu_check: timed out" >&2
exit $rc
