#!/usr/bin/env bash
# Generates the data the tests and the demo read (git-ignored, idempotent):
# digits arrays and the English token files under data/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f data/.ready ]; then
  /usr/bin/python3 tools/prepare_data.py --out data
  touch data/.ready
fi
