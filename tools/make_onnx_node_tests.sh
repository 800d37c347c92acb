#!/usr/bin/env bash
# Re-creates tests/data/onnx_node/ (ONNX backend node tests of opsets Debian's
# libonnx-testdata does not have: PyPI onnx 1.17's shipped data, opsets <= 22, and the
# cases of PyPI onnx 1.23's generators, opsets <= 28) for the ops kiln imports, and
# tests/data/onnx_schema_versions.json. Needs build/bin/kiln (bash tools/build.sh) and the
# venv of tools/make_hf_fixtures.sh (made here if missing). Run by hand; the outputs are
# committed. See tools/select_onnx_node_tests.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-hf
[ -x build/bin/kiln ] || { echo "make_onnx_node_tests: build kiln first (bash tools/build.sh)" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
"$VENV/bin/pip" install -q onnx==1.23.2 numpy
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: onnx==1.17.0 -d "$TMP/whl"
"$VENV/bin/python" -m zipfile -e "$TMP"/whl/onnx-1.17.0-*.whl "$TMP/w117"
build/bin/kiln ops --names > "$TMP/ops.txt"
"$VENV/bin/python" tools/select_onnx_node_tests.py --ops "$TMP/ops.txt" \
  --onnx117 "$TMP/w117/onnx/backend/test/data/node" --out tests/data/onnx_node \
  --schemas tests/data/onnx_schema_versions.json
du -sh tests/data/onnx_node
