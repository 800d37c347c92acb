#!/usr/bin/env bash
# Installs every system dependency of kiln from Debian 12 packages. Idempotent:
# packages already present are skipped by apt. Run as root (or with sudo).
set -euo pipefail
PKGS=(
  cmake g++ make pkg-config
  libprotobuf-dev protobuf-compiler libonnx-dev libonnx-testdata
  llvm-16-dev libzstd-dev libdnnl-dev libomp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  libglpk-dev libssl-dev clang-format ccache
  libopenmpi-dev openmpi-bin iproute2  # data-parallel training (runtime/comm); iproute2: the two-host test (ip netns)
  tmux libxml2-utils  # tests: the progress bar in a real terminal; xmllint validates the SVG plots
  clang-14 libclang-rt-14-dev  # tools/fuzz.sh: clang++-14 and its libFuzzer runtime
  python3 python3-numpy python3-onnx python3-torch python3-sklearn jargon-text
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PKGS[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
