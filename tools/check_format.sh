#!/usr/bin/env bash
# Checks that every C++ source and header of kiln is formatted with the checked-in style
# (.clang-format: Google style, 120 columns). Run by ctest as `format_check`; exits 1 and
# names the files that differ. Fix them with: clang-format -i FILE...
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "check_format: clang-format is not installed (tools/install_deps.sh installs it)"; exit 1; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cpp' '*.h')
else
  mapfile -t files < <(find . -path ./build -prune -o \( -name '*.cpp' -o -name '*.h' \) -print | sed 's|^\./||' | sort)
fi
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -ne 0 ]; then
  echo "check_format: ${#bad[@]} of ${#files[@]} files are not formatted as .clang-format says: ${bad[*]}"
  echo "check_format: fix with: clang-format -i ${bad[*]}"
  exit 1
fi
echo "check_format: ${#files[@]} files formatted ($(clang-format --version | head -1))"
