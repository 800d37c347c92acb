#!/usr/bin/env bash
# Generates the data the tests and the demo read (git-ignored, idempotent):
# digits arrays, the English token files and the variable-length sentence and paragraph
# sets under data/ (rerun when a file that a newer tools/prepare_data.py writes is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f data/.ready ] || [ ! -f data/text/paragraphs_eval.jsonl ]; then
  /usr/bin/python3 tools/prepare_data.py --out data
  touch data/.ready
fi
